"""A Llama GGUF file whose matrices are block-quantised types gguf-py can de-quantise but not quantise (K-quants), made
of random valid blocks: random bytes with finite f16 block scales. The key/values (tokenizer included) are copied from
a llama.cpp reference file with the shapes changed, so transformers' GGUF loader reads it as a Llama model."""

from __future__ import annotations

from pathlib import Path

import numpy as np

# Offsets of each type's f16 scale fields within a block (d, and dmin where there is one): ggml's block structs.
SCALE_AT = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q2_K": (80, 82), "Q3_K": (108,),
            "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,), "IQ3_XXS": (0,),
            "IQ3_S": (0,), "IQ1_S": (0,), "IQ4_NL": (0,), "IQ4_XS": (0,), "TQ1_0": (52,), "TQ2_0": (64,),
            "IQ1_M": (), "MXFP4": (), "NVFP4": ()}  # IQ1_M: d in the top nibbles of its scales; MXFP4: an e8m0 byte
HIDDEN, FFN, HEADS, KV_HEADS = 256, 512, 4, 2  # K-quant blocks are 256 values: every row length a multiple of it
# GGUF tensor -> type: every type once, the permuted q/k among them
TYPES = {"token_embd.weight": "Q4_K", "blk.0.attn_q.weight": "Q4_K", "blk.0.attn_k.weight": "Q6_K", "blk.0.attn_v.weight": "Q8_0",
         "blk.0.attn_output.weight": "Q4_0", "blk.0.ffn_gate.weight": "Q5_K", "blk.0.ffn_up.weight": "BF16",
         "blk.0.ffn_down.weight": "Q6_K", "output.weight": "Q3_K", "blk.1.attn_q.weight": "F16", "blk.1.attn_k.weight": "Q2_K",
         "blk.1.attn_v.weight": "Q4_1", "blk.1.attn_output.weight": "Q5_0", "blk.1.ffn_gate.weight": "Q8_0",
         "blk.1.ffn_up.weight": "Q4_K", "blk.1.ffn_down.weight": "F32"}


def random_blocks(rng: np.random.Generator, shape: tuple[int, ...], kind: str) -> np.ndarray:
    """Stored bytes (rows, row bytes) of a `kind` tensor of logical `shape`: random, with finite block scales."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    for at in SCALE_AT[kind]:
        raw[:, at:at + 2] = _scales(rng, raw.shape[0]).view(np.uint8).reshape(-1, 2)
    if kind == "IQ1_M":  # the f16 d is spread over the top nibbles of the four uint16 scales (bytes 48..55)
        d = _scales(rng, raw.shape[0]).view(np.uint16).astype(np.uint16)
        scales = raw[:, 48:56].copy().view(np.uint16)
        for k in range(4):
            scales[:, k] = (scales[:, k] & 0x0FFF) | (((d >> (4 * k)) & 0xF) << 12)
        raw[:, 48:56] = scales.view(np.uint8)
    elif kind == "MXFP4":  # an e8m0 exponent byte: scales 2^-10 .. 2^2, far from float32's overflow
        raw[:, 0] = rng.integers(117, 130, size=raw.shape[0], dtype=np.uint8)
    return raw.reshape(*shape[:-1], cols // block * size)


def _scales(rng: np.random.Generator, n: int) -> np.ndarray:
    """`n` finite, positive f16 block scales."""
    return rng.uniform(0.002, 0.02, size=n).astype(np.float16)


def shapes(vocab: int) -> dict[str, tuple[int, ...]]:
    """Logical shapes of the file's tensors."""
    found: dict[str, tuple[int, ...]] = {"token_embd.weight": (vocab, HIDDEN), "output.weight": (vocab, HIDDEN),
                                         "output_norm.weight": (HIDDEN,)}
    head = HIDDEN // HEADS
    for i in (0, 1):
        found |= {f"blk.{i}.attn_norm.weight": (HIDDEN,), f"blk.{i}.ffn_norm.weight": (HIDDEN,),
                  f"blk.{i}.attn_q.weight": (HIDDEN, HIDDEN), f"blk.{i}.attn_k.weight": (KV_HEADS * head, HIDDEN),
                  f"blk.{i}.attn_v.weight": (KV_HEADS * head, HIDDEN), f"blk.{i}.attn_output.weight": (HIDDEN, HIDDEN),
                  f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN), f"blk.{i}.ffn_up.weight": (FFN, HIDDEN),
                  f"blk.{i}.ffn_down.weight": (HIDDEN, FFN)}
    return found


def build(reference: Path, out: Path, seed: int = 0) -> Path:
    """Write the K-quant Llama to `out`, key/values (and tokenizer) from the llama.cpp file `reference`."""
    import gguf

    rng = np.random.default_rng(seed)
    reader = gguf.GGUFReader(reference)
    writer = gguf.GGUFWriter(str(out), "llama")
    head = HIDDEN // HEADS
    changed = {"llama.embedding_length": HIDDEN, "llama.feed_forward_length": FFN, "llama.attention.head_count": HEADS,
               "llama.attention.head_count_kv": KV_HEADS, "llama.attention.key_length": head,
               "llama.attention.value_length": head, "llama.rope.dimension_count": head, "general.file_type": 15}
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        kind = field.types[0]
        value = changed.get(field.name, field.contents())
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    vocab = int(reader.fields["llama.vocab_size"].contents())
    for name, shape in shapes(vocab).items():
        kind = TYPES.get(name, "F32")
        if kind in ("F32", "F16"):
            values = rng.normal(0, 0.5, size=shape).astype(np.float32 if kind == "F32" else np.float16)
            writer.add_tensor(name, values)
        elif kind == "BF16":
            bits = (rng.normal(0, 0.5, size=shape).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
            writer.add_tensor(name, bits.view(np.uint8).reshape(*shape[:-1], -1), raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            writer.add_tensor(name, random_blocks(rng, shape, kind), raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def reference_values(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of GGUF file `path` as gguf-py de-quantises it (float32), q/k rows put back in HF order as
    transformers' GGUF loader does (per head: (half, 2) rows -> (2, half)); keyed by GGUF name."""
    import gguf

    reader = gguf.GGUFReader(path)
    heads = int(reader.fields["llama.attention.head_count"].contents()) if "llama.attention.head_count" in reader.fields else 0
    kv = int(reader.fields["llama.attention.head_count_kv"].contents()) if heads else 0
    arch = reader.fields["general.architecture"].contents()
    found = {}
    for t in reader.tensors:
        values = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        values = values.reshape(tuple(int(d) for d in reversed(t.shape)))
        n = heads if ".attn_q." in t.name else kv if ".attn_k." in t.name else 0
        if arch == "llama" and n:
            values = values.reshape(n, values.shape[0] // n // 2, 2, *values.shape[1:]).swapaxes(1, 2).reshape(values.shape)
        found[t.name] = values
    return found


def build_wide(out: Path, vocab: int = 32768, hidden: int = 1024, seed: int = 0, wide: tuple[str, str] = ("Q4_K", "Q6_K")) -> Path:
    """A one-layer Llama GGUF whose embeddings and output (types `wide`: Q4_K and Q6_K by default) are `vocab` x
    `hidden`: 128 MiB each once de-quantised to float32 at the defaults; no tokenizer (convert it without extras)."""
    import gguf

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(out), "llama")
    heads = hidden // 64
    for key, value in (("block_count", 1), ("embedding_length", hidden), ("feed_forward_length", 2 * hidden),
                       ("attention.head_count", heads), ("attention.head_count_kv", heads // 4), ("context_length", 2048)):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    kinds = {"token_embd.weight": wide[0], "output.weight": wide[1], "blk.0.attn_q.weight": "Q4_K", "blk.0.attn_k.weight": "Q4_K",
             "blk.0.attn_v.weight": "Q8_0", "blk.0.attn_output.weight": "Q4_K", "blk.0.ffn_gate.weight": "Q4_K",
             "blk.0.ffn_up.weight": "Q4_K", "blk.0.ffn_down.weight": "Q6_K"}
    kv = hidden // 4
    tensor_shapes = {"token_embd.weight": (vocab, hidden), "output.weight": (vocab, hidden), "output_norm.weight": (hidden,),
                     "blk.0.attn_norm.weight": (hidden,), "blk.0.ffn_norm.weight": (hidden,), "blk.0.attn_q.weight": (hidden, hidden),
                     "blk.0.attn_k.weight": (kv, hidden), "blk.0.attn_v.weight": (kv, hidden), "blk.0.attn_output.weight": (hidden, hidden),
                     "blk.0.ffn_gate.weight": (2 * hidden, hidden), "blk.0.ffn_up.weight": (2 * hidden, hidden),
                     "blk.0.ffn_down.weight": (hidden, 2 * hidden)}
    for name, shape in tensor_shapes.items():
        kind = kinds.get(name)
        if kind is None:
            writer.add_tensor(name, np.ones(shape, np.float32))
        else:
            writer.add_tensor(name, random_blocks(rng, shape, kind), raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def dequantisable_types() -> list[str]:
    """Every GGML type the installed gguf-py de-quantises (`gguf.quants.dequantize`), F32 and F16 included."""
    import gguf

    return [t.name for t in gguf.GGMLQuantizationType if t.name in ("F32", "F16") or t in gguf.quants._type_traits]


def build_one_type(out: Path, kind: str, rows: int = 37, seed: int = 0) -> Path:
    """A Llama GGUF whose embeddings (`rows` x two blocks' columns, at least 512) and first layer's q projection (4 heads,
    permuted rows) are `kind`, of random valid blocks, its norm F32: the smallest file `gguf_to_hf` reads one type from.
    `rows` is odd so that row chunks end mid-tensor at whole rows, never at a multiple of the tensor."""
    import gguf

    rng = np.random.default_rng(seed)
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][0]
    cols = max(512, 2 * block)
    writer = gguf.GGUFWriter(str(out), "llama")
    for key, value in (("block_count", 1), ("embedding_length", cols), ("attention.head_count", 4),
                       ("attention.head_count_kv", 4), ("context_length", 128)):
        writer.add_uint32(f"llama.{key}", value)
    for name, shape in (("token_embd.weight", (rows, cols)), ("blk.0.attn_q.weight", (64, cols)), ("output_norm.weight", (cols,))):
        if name == "output_norm.weight" or kind == "F32":
            writer.add_tensor(name, rng.normal(0, 0.5, size=shape).astype(np.float32))
        elif kind == "F16":
            writer.add_tensor(name, rng.normal(0, 0.5, size=shape).astype(np.float16))
        elif kind == "BF16":
            bits = (rng.normal(0, 0.5, size=shape).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
            writer.add_tensor(name, bits.view(np.uint8).reshape(*shape[:-1], -1), raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            writer.add_tensor(name, random_blocks(rng, shape, kind), raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
