"""GGUF files written by hand, byte by byte, so tests can build any header, honest or hostile, and any size:
tensor data is left as a hole (a sparse file) unless given."""

from __future__ import annotations

import struct
from pathlib import Path

TYPES = {"UINT8": 0, "INT8": 1, "UINT16": 2, "INT16": 3, "UINT32": 4, "INT32": 5, "FLOAT32": 6, "BOOL": 7, "STRING": 8,
         "ARRAY": 9, "UINT64": 10, "INT64": 11, "FLOAT64": 12}
FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
# GGML type name -> (id, elements per block, bytes per block)
GGML = {"F32": (0, 1, 4), "F16": (1, 1, 2), "Q4_0": (2, 32, 18), "Q8_0": (8, 32, 34), "Q4_K": (12, 256, 144),
        "Q6_K": (14, 256, 210), "BF16": (30, 1, 2), "I32": (26, 1, 4)}


def string(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def value(kind: str, item) -> bytes:
    """A value without its type id: scalars, strings, or ("ITEMTYPE", [items]) arrays."""
    code = TYPES[kind]
    if code == 8:
        return string(item)
    if code == 9:
        sub, items = item
        out = struct.pack("<IQ", TYPES[sub], len(items))
        if TYPES[sub] in FORMATS:
            return out + struct.pack(f"<{len(items)}{FORMATS[TYPES[sub]]}", *items)
        return out + b"".join(value(sub, i) for i in items)
    return struct.pack("<" + FORMATS[code], item)


def kv(key: str, kind: str, item) -> bytes:
    return string(key) + struct.pack("<I", TYPES[kind]) + value(kind, item)


def record(name: str, shape: tuple[int, ...], ggml: str | int, offset: int) -> bytes:
    """One tensor record; `shape` in PyTorch order (written reversed, as GGUF does)."""
    type_id = GGML[ggml][0] if isinstance(ggml, str) else ggml
    return string(name) + struct.pack("<I", len(shape)) + b"".join(struct.pack("<Q", d) for d in reversed(shape)) + struct.pack("<IQ", type_id, offset)


def nbytes(shape: tuple[int, ...], ggml: str) -> int:
    _, block, size = GGML[ggml]
    n = 1
    for d in shape:
        n *= d
    return n // block * size


def write(path: Path, kvs: list[bytes], tensors: list[tuple[str, tuple[int, ...], str]], *, data: dict[str, bytes] | None = None,
          alignment: int = 32, counts: tuple[int, int] | None = None, version: int = 3) -> Path:
    """A GGUF file: `kvs` from `kv()`, tensors laid out one after the other (aligned); data holes unless `data` names them.
    `counts` overrides the (tensor count, key/value count) the header claims."""
    data = data or {}
    records, offset, placed = b"", 0, []
    for name, shape, ggml in tensors:
        records += record(name, shape, ggml, offset)
        placed.append((name, offset))
        offset += nbytes(shape, ggml)
        offset += -offset % alignment
    n_tensors, n_kv = counts or (len(tensors), len(kvs))
    head = b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv) + b"".join(kvs) + records
    start = len(head) + (-len(head) % alignment)
    with open(path, "wb") as fh:
        fh.write(head + bytes(start - len(head)))
        for name, at in placed:
            if name in data:
                fh.seek(start + at)
                fh.write(data[name])
        fh.truncate(start + offset)
    return path


def llama_405b(path: Path, *, vocab: int = 128_256, merges: int = 280_147) -> Path:
    """A Llama 3.1 405B-shaped GGUF (126 layers, hidden 16384, FFN 53248, 128 / 8 heads, Q4_K matrices, F32 norms, a
    128,256-token vocabulary with 280,147 merges): a real header, the ~230 GB of data a hole."""
    hidden, ffn, layers, heads, kv_heads = 16384, 53248, 126, 128, 8
    head_dim = hidden // heads
    kvs = [kv("general.architecture", "STRING", "llama"), kv("general.name", "STRING", "Llama 405B shaped"),
           kv("llama.block_count", "UINT32", layers), kv("llama.embedding_length", "UINT32", hidden),
           kv("llama.feed_forward_length", "UINT32", ffn), kv("llama.attention.head_count", "UINT32", heads),
           kv("llama.attention.head_count_kv", "UINT32", kv_heads), kv("general.file_type", "UINT32", 15),
           kv("tokenizer.ggml.model", "STRING", "gpt2"),
           kv("tokenizer.ggml.tokens", "ARRAY", ("STRING", [f"tok{k}" for k in range(vocab)])),
           kv("tokenizer.ggml.token_type", "ARRAY", ("INT32", [1] * vocab)),
           kv("tokenizer.ggml.merges", "ARRAY", ("STRING", [f"m{k} x" for k in range(merges)]))]
    tensors = [("token_embd.weight", (vocab, hidden), "Q4_K")]
    for i in range(layers):
        tensors += [(f"blk.{i}.attn_norm.weight", (hidden,), "F32"), (f"blk.{i}.attn_q.weight", (hidden, hidden), "Q4_K"),
                    (f"blk.{i}.attn_k.weight", (kv_heads * head_dim, hidden), "Q4_K"),
                    (f"blk.{i}.attn_v.weight", (kv_heads * head_dim, hidden), "Q6_K"),
                    (f"blk.{i}.attn_output.weight", (hidden, hidden), "Q4_K"), (f"blk.{i}.ffn_norm.weight", (hidden,), "F32"),
                    (f"blk.{i}.ffn_gate.weight", (ffn, hidden), "Q4_K"), (f"blk.{i}.ffn_up.weight", (ffn, hidden), "Q4_K"),
                    (f"blk.{i}.ffn_down.weight", (hidden, ffn), "Q6_K")]
    tensors += [("output_norm.weight", (hidden,), "F32"), ("output.weight", (vocab, hidden), "Q6_K")]
    return write(path, kvs, tensors)
