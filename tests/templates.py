"""Chat templates in each tool-call family's conventions, for test GGUFs.

They keep the embedded model's own turn tokens (``<|im_start|>``, ``<|im_end|>``), so the
tiny model stays coherent and ends its turns, and describe tools, render calls and tool
results the way that family's real template does: Llama 3.1/3.2 ("Environment: ipython",
a ``{"name": ..., "parameters": ...}`` JSON call, ``ipython`` turns for results) and
Mistral (``[AVAILABLE_TOOLS]``, ``[TOOL_CALLS][...]`` with nine-character ids,
``[TOOL_RESULTS]``), and a Qwen3-style thinking template; ``with_template`` writes a
copy of a GGUF file with one of them (the tests' fixtures and ``benchmarks/reasoning.py``).
"""

from __future__ import annotations

import struct
from pathlib import Path

LLAMA3_TEMPLATE = """\
{%- if messages[0].role == 'system' %}{% set system = messages[0].content %}\
{% else %}{% set system = '' %}{% endif %}
{%- if tools %}<|im_start|>system
Environment: ipython
{{ system }}<|im_end|>
<|im_start|>user
Given the following functions, please respond with a JSON for a function call with its \
proper arguments that best answers the given prompt.

Respond in the format {"name": function name, "parameters": dictionary of argument name \
and its value}. Do not use variables.

{% for tool in tools %}{{ tool | tojson }}

{% endfor %}<|im_end|>
{% elif system %}<|im_start|>system
{{ system }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'tool' %}<|im_start|>ipython
{{ message.content }}<|im_end|>
{% elif message.tool_calls %}<|im_start|>assistant
{% for call in message.tool_calls %}{"name": "{{ call.function.name }}", "parameters": \
{{ call.function.arguments | tojson }}}{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

MISTRAL_TEMPLATE = """\
{%- for message in messages %}
{%- if message.role == 'system' %}<|im_start|>system
{{ message.content }}<|im_end|>
{% elif message.role == 'user' %}<|im_start|>user
{% if loop.last and tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}\
[INST]{{ message.content }}[/INST]<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
[TOOL_RESULTS]{"content": {{ message.content | tojson }}, "call_id": \
"{{ message.tool_call_id }}"}[/TOOL_RESULTS]<|im_end|>
{% elif message.tool_calls %}<|im_start|>assistant
{% for call in message.tool_calls %}\
{% if call.id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric \
strings with length 9!') }}{% endif %}\
[TOOL_CALLS][{"name": "{{ call.function.name }}", "arguments": \
{{ call.function.arguments | tojson }}, "id": "{{ call.id }}"}]{% endfor %}<|im_end|>
{% else %}<|im_start|>assistant
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

#: a Qwen3-style thinking template: the generation prompt opens ``<think>`` (the model
#: reasons first and ends the section with ``</think>``), and ``enable_thinking=false``
#: closes it empty in the prompt, as Qwen3's own template does
THINKING_TEMPLATE = """\
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""


#: bytes of each fixed-size GGUF value type (8 is a string, 9 an array)
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _past_value(raw: bytes, pos: int, kind: int) -> int:
    """The offset just past a GGUF value of type ``kind`` that starts at ``pos``."""
    if kind == 8:
        return pos + 8 + struct.unpack_from("<Q", raw, pos)[0]
    if kind != 9:
        return pos + _SIZES[kind]
    item, count = struct.unpack_from("<IQ", raw, pos)
    pos += 12
    if item in _SIZES:
        return pos + _SIZES[item] * count
    for _ in range(count):
        pos = _past_value(raw, pos, item)
    return pos


def with_template(source: Path, target: Path, template: str) -> None:
    """Copy a GGUF file with its ``tokenizer.chat_template`` value replaced.

    The header is stepped over with ``struct`` (the gguf package's reader decodes every
    vocabulary entry into an array: seconds a copy, for three offsets); the tensor data
    is copied as it is, after the header padded to the file's alignment.
    """
    raw = source.read_bytes()
    tensors, kvs = struct.unpack_from("<QQ", raw, 8)
    key = b"tokenizer.chat_template"
    pos, span, alignment = 24, None, 32
    for _ in range(kvs):
        start = pos
        size = struct.unpack_from("<Q", raw, pos)[0]
        name = raw[pos + 8 : pos + 8 + size]
        kind = struct.unpack_from("<I", raw, pos + 8 + size)[0]
        pos = _past_value(raw, pos + 12 + size, kind)
        if name == key:
            span = (start, pos)
        elif name == b"general.alignment":
            alignment = struct.unpack_from("<I", raw, pos - 4)[0]
    for _ in range(tensors):
        pos += 8 + struct.unpack_from("<Q", raw, pos)[0]
        dims = struct.unpack_from("<I", raw, pos)[0]
        pos += 4 + 8 * dims + 4 + 8
    assert span is not None, f"{source} has no {key.decode()}"
    value = template.encode("utf-8")
    kv = struct.pack("<Q", len(key)) + key + struct.pack("<IQ", 8, len(value)) + value
    header = raw[: span[0]] + kv + raw[span[1] : pos]
    header += b"\0" * (-len(header) % alignment)
    target.write_bytes(header + raw[pos + (-pos % alignment) :])
