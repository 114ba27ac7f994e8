"""A test reranker GGUF made from the embedded chat model (no reranker can be fetched here).

``as_reranker`` writes a copy of a llama-architecture GGUF that llama.cpp loads as a
``qwen3`` model with ``pooling_type`` rank: the llama loader takes no classification
head (an extra tensor fails the load), the qwen3 one does. Qwen3 also wants per-layer
q/k norms, added as ones; those (and qwen3's NEOX rope over weights ordered for
llama's) change the network, so its scores are not relevance: they are a function of
the hidden state that tests can compute themselves.

What llama.cpp does for a qwen3 rank model (measured on the vendored build): it takes
the hidden state ``h`` of each sequence's last token after the output norm (what
``last`` pooling returns, unnormalised), multiplies by ``cls.output.weight`` (one row per
``classifier.output_labels`` entry) and applies a softmax over those outputs. With one
output the softmax makes every score 1.0; so the head has two rows, ``w`` and zeros
(labels ``yes``, ``no``, as real Qwen3 rerankers convert), and the first output, the
score tokenbelt reads, is ``softmax([w . h, 0])[0] = sigmoid(w . h)``.

The copy is made at the byte level (as ``templates.with_template`` does): keys renamed,
the tensor infos and the quantized data copied raw, the new tensors appended.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

#: GGUF value types: fixed sizes, and the two with a length
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_F32 = 0  # ggml's type number for float32 tensors


def _string(value: str) -> bytes:
    data = value.encode("utf-8")
    return struct.pack("<Q", len(data)) + data


def _skip_value(raw: bytes, at: int, vtype: int) -> int:
    """The offset just past a value of type ``vtype`` that starts at ``at``."""
    if vtype == _STRING:
        return at + 8 + int(struct.unpack_from("<Q", raw, at)[0])
    if vtype == _ARRAY:
        item, count = struct.unpack_from("<IQ", raw, at)
        at += 12
        if item in _SIZES:
            return int(at + count * _SIZES[item])
        for _ in range(count):
            at = _skip_value(raw, at, item)
        return at
    return at + _SIZES[vtype]


def _tensor_info(name: str, dims: tuple[int, ...], offset: int) -> bytes:
    shape = struct.pack(f"<I{len(dims)}Q", len(dims), *dims)
    return _string(name) + shape + struct.pack("<IQ", _F32, offset)


def sigmoid(x: np.ndarray) -> np.ndarray:
    """The logistic function (float64): a file from ``as_reranker`` scores a pair whose
    hidden state is ``h`` ``sigmoid(w . h)``."""
    return np.asarray(1.0 / (1.0 + np.exp(-x.astype(np.float64))))


def as_reranker(source: Path, target: Path, seed: int = 0) -> np.ndarray:
    """Write ``target``: ``source`` (a llama GGUF) as a qwen3 reranker (see the module).

    Returns ``w``, the head's scoring row (float32, ``n_embd`` long, a random unit vector
    drawn from ``seed``): a pair's score is ``sigmoid(w . h)``, ``h`` its last token's
    hidden state (``last`` pooling of the same file, unnormalised).
    """
    raw = source.read_bytes()
    magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", raw, 0)
    if magic != b"GGUF" or version != 3:
        raise ValueError(f"{source} is not a GGUF v3 file")
    at = 24
    kv = b""
    values: dict[str, tuple[int, int]] = {}  # key: (type, offset of the value)
    for _ in range(n_kv):
        (length,) = struct.unpack_from("<Q", raw, at)
        key = raw[at + 8 : at + 8 + length].decode("utf-8")
        at += 8 + length
        (vtype,) = struct.unpack_from("<I", raw, at)
        end = _skip_value(raw, at + 4, vtype)
        values[key] = (vtype, at + 4)
        if key == "general.architecture":
            if raw[at + 4 : end] != _string("llama"):
                raise ValueError(f"{source} is not a llama-architecture GGUF")
            kv += _string(key) + struct.pack("<I", _STRING) + _string("qwen3")
        else:
            if key.startswith("llama."):
                key = "qwen3." + key.removeprefix("llama.")
            kv += _string(key) + raw[at:end]
        at = end

    def number(key: str) -> int:
        vtype, where = values[key]
        assert vtype == _UINT32, key
        return int(struct.unpack_from("<I", raw, where)[0])

    n_embd = number("llama.embedding_length")
    n_layer = number("llama.block_count")
    head_dim = n_embd // number("llama.attention.head_count")
    alignment = number("general.alignment") if "general.alignment" in values else 32
    kv += _string("qwen3.pooling_type") + struct.pack("<II", _UINT32, 4)  # rank
    labels = b"".join(_string(label) for label in ("yes", "no"))
    kv += _string("qwen3.classifier.output_labels") + struct.pack("<IIQ", _ARRAY, _STRING, 2)
    kv += labels

    infos_start = at
    for _ in range(n_tensors):
        (length,) = struct.unpack_from("<Q", raw, at)
        at += 8 + length
        (n_dims,) = struct.unpack_from("<I", raw, at)
        at += 4 + 8 * n_dims + 4 + 8
    infos = raw[infos_start:at]
    data_offset = at + (-at % alignment)

    rng = np.random.default_rng(seed)
    w = rng.standard_normal(n_embd).astype(np.float32)
    w /= np.linalg.norm(w)
    ones = np.ones(head_dim, dtype=np.float32).tobytes()
    added: list[tuple[str, tuple[int, ...], bytes]] = []
    for i in range(n_layer):
        added.append((f"blk.{i}.attn_q_norm.weight", (head_dim,), ones))
        added.append((f"blk.{i}.attn_k_norm.weight", (head_dim,), ones))
    head = np.stack([w, np.zeros_like(w)])  # ggml shape {n_embd, 2}: one row per label
    added.append(("cls.output.weight", (n_embd, 2), head.tobytes()))

    data = bytearray(raw[data_offset:])
    for name, dims, payload in added:
        data += b"\0" * (-len(data) % alignment)
        infos += _tensor_info(name, dims, len(data))
        data += payload
    header = struct.pack("<4sIQQ", b"GGUF", 3, n_tensors + len(added), n_kv + 2) + kv + infos
    header += b"\0" * (-len(header) % alignment)
    target.write_bytes(header + bytes(data))
    return w
