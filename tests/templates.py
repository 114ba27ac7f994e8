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

from tokenbelt.engines import read_header

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


def with_template(source: Path, target: Path, template: str) -> None:
    """Copy a GGUF file with its ``tokenizer.chat_template`` value replaced.

    Where the value lies and where the tensor infos end come from tokenbelt's own header
    reader (the gguf package's decodes every vocabulary entry: seconds a copy); the tensor
    data is copied as it is, after the header padded to the file's alignment.
    """
    header = read_header(source)
    key = b"tokenizer.chat_template"
    span = header.spans.get(key.decode())
    assert span is not None, f"{source} has no {key.decode()}"
    alignment = int(header.metadata.get("general.alignment", 32))
    pos = header.infos_end
    raw = source.read_bytes()
    value = template.encode("utf-8")
    kv = struct.pack("<Q", len(key)) + key + struct.pack("<IQ", 8, len(value)) + value
    head = raw[: span[0]] + kv + raw[span[1] : pos]
    head += b"\0" * (-len(head) % alignment)
    target.write_bytes(head + raw[pos + (-pos % alignment) :])
