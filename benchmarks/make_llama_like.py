"""Benchmark inputs: a synthetic Llama-shaped checkpoint, a transformers-saved one, and a 100k-tiny-tensor one.

The synthetic checkpoint has real Llama key names and TinyLlama proportions (hidden 2048, intermediate 5632,
32 heads, 4 kv heads), F32 so a bf16 cast halves it, in the HF sharded layout with an index and a
config.json. The layer count and vocabulary are chosen to reach the requested size. Each input is written
once into its folder together with a `bench_input.json` stamp; a folder whose stamp matches is reused.

Usage (run.py calls these; they are also handy alone):
    python benchmarks/make_llama_like.py synth DIR [--size-gib 2] [--shards 4] [--dtype BF16]
    python benchmarks/make_llama_like.py hf DIR
    python benchmarks/make_llama_like.py tiny DIR [--tensors 100000]
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from workbench.catalog import TensorInfo
from workbench.output.safetensors import SafetensorsWriter, layout_file, write_index

STAMP = "bench_input.json"
GIB = 1 << 30


@dataclass(frozen=True)
class LlamaShape:
    """The dimensions that decide a Llama checkpoint's tensor names and shapes."""

    hidden: int = 2048
    intermediate: int = 5632
    heads: int = 32
    kv_heads: int = 4
    layers: int = 22
    vocab: int = 32000

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every tensor, in the order transformers lists a LlamaForCausalLM state dict."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        specs: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (self.vocab, h))]
        for i in range(self.layers):
            p = f"model.layers.{i}."
            specs += [
                (p + "self_attn.q_proj.weight", (h, h)),
                (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.o_proj.weight", (h, h)),
                (p + "mlp.gate_proj.weight", (self.intermediate, h)),
                (p + "mlp.up_proj.weight", (self.intermediate, h)),
                (p + "mlp.down_proj.weight", (h, self.intermediate)),
                (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,)),
            ]
        specs += [("model.norm.weight", (h,)), ("lm_head.weight", (self.vocab, h))]
        return specs

    def layer_elements(self) -> int:
        return sum(int(np.prod(s)) for n, s in LlamaShape(**{**asdict(self), "layers": 1}).tensors() if ".layers." in n)

    def hf_config(self) -> dict:
        """A config.json transformers accepts for this shape (untied embeddings, so lm_head is stored)."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "num_hidden_layers": self.layers,
            "vocab_size": self.vocab,
            "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
        }


def llama_shape_for_size(size_bytes: int) -> LlamaShape:
    """TinyLlama widths; layers fill ~88 % of the size (as in TinyLlama), embeddings + lm_head the rest."""
    base = LlamaShape()
    layer_bytes = base.layer_elements() * 4
    layers = max(1, int(size_bytes * 0.88 // layer_bytes))
    rest = max(size_bytes - layers * layer_bytes, 0)
    vocab = max(256, min(base.vocab, int(rest // (2 * base.hidden * 4)) // 64 * 64))
    return LlamaShape(layers=layers, vocab=vocab)


def shard_evenly(specs: list[tuple[str, tuple[int, ...], str]], shards: int) -> list[list[TensorInfo]]:
    """Cut the tensor list, in key order, into about `shards` files of similar size.

    A tensor goes to the file whose share of the bytes its first byte falls in (fewer files when single
    tensors are larger than a share).
    """
    infos = [TensorInfo(name, dtype, tuple(shape)) for name, shape, dtype in specs]
    total = sum(t.nbytes for t in infos) or 1
    out: dict[int, list[TensorInfo]] = {}
    offset = 0
    for info in infos:
        out.setdefault(min(shards - 1, offset * shards // total), []).append(info)
        offset += info.nbytes
    return [out[k] for k in sorted(out)]


def write_sharded(
    folder: Path,
    specs: list[tuple[str, tuple[int, ...], str]],
    n_shards: int,
    fill: Callable[[TensorInfo], np.ndarray],
) -> int:
    """Write `specs` as HF sharded safetensors (or one model.safetensors) with our streaming writer."""
    shards = shard_evenly(specs, n_shards)
    n = len(shards)
    weight_map: dict[str, str] = {}
    total = 0
    for k, infos in enumerate(shards, start=1):
        file = "model.safetensors" if n == 1 else f"model-{k:05d}-of-{n:05d}.safetensors"
        layout = layout_file(file, infos)
        with SafetensorsWriter(folder, layout) as writer:
            for info in layout.tensors:
                if info.nbytes:
                    writer.write(info.name, fill(info).data)
                weight_map[info.name] = file
                total += info.nbytes
            writer.commit()
    if n > 1:
        write_index(folder, weight_map, total)
    return total


def _random_filler(seed: int) -> Callable[[TensorInfo], np.ndarray]:
    rng = np.random.default_rng(seed)

    def fill(info: TensorInfo) -> np.ndarray:
        if len(info.shape) == 1:  # norms start at one, like a fresh model
            values = np.ones(info.shape, dtype=np.float32)
        else:
            values = rng.standard_normal(info.numel, dtype=np.float32)
            values *= 0.02
        if info.dtype == "BF16":  # the upper half of each float32 (truncation; the values only need to be plausible)
            return (values.reshape(-1).view(np.uint32) >> 16).astype(np.uint16)
        return values

    return fill


def _stamp_matches(folder: Path, stamp: dict) -> bool:
    try:
        return json.loads((folder / STAMP).read_text()) == stamp
    except (OSError, ValueError):
        return False


def _fresh(folder: Path) -> None:
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)


def make_synthetic_llama(folder: Path, size_gib: float = 2.0, shards: int = 4, seed: int = 0, dtype: str = "F32") -> dict:
    """Write (or reuse) the Llama-shaped sharded checkpoint of about `size_gib` GiB (F32 or BF16); returns its stamp."""
    width = {"F32": 4, "BF16": 2}[dtype]
    shape = llama_shape_for_size(int(size_gib * GIB * 4 / width))  # the same bytes in either dtype
    specs = [(n, s, dtype) for n, s in shape.tensors()]
    total = sum(int(np.prod(s)) * width for _, s, _ in specs)
    stamp = {"kind": "synthetic-llama", "shape": asdict(shape), "shards": shards, "seed": seed, "bytes": total, "version": 2}
    if dtype != "F32":  # F32 stamps stay as they were, so existing inputs are reused
        stamp["dtype"] = dtype
    if _stamp_matches(folder, stamp):
        return stamp
    _fresh(folder)
    write_sharded(folder, specs, shards, _random_filler(seed))
    config = shape.hf_config()
    if dtype == "BF16":
        config["torch_dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / STAMP).write_text(json.dumps(stamp))
    return stamp


def make_transformers_llama(folder: Path, seed: int = 0) -> dict:
    """A randomly initialised LlamaForCausalLM (~330 MB F32) saved by transformers' own save_pretrained."""
    stamp = {"kind": "transformers-llama", "seed": seed, "version": 1}
    if _stamp_matches(folder, stamp):
        return stamp
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    _fresh(folder)
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=4,
        num_hidden_layers=6, vocab_size=8000, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(folder, max_shard_size="100MB")
    stamp["transformers"] = transformers.__version__
    (folder / STAMP).write_text(json.dumps(stamp))
    return stamp


def tiny_llama_shape(n_tensors: int) -> LlamaShape:
    """Llama with toy widths and enough layers to reach `n_tensors` tensors (9 per layer + 3)."""
    return LlamaShape(hidden=4, intermediate=8, heads=2, kv_heads=1, vocab=16, layers=max(1, -(-(n_tensors - 3) // 9)))


def make_tiny_tensors(folder: Path, n_tensors: int = 100_000, shards: int = 4) -> dict:
    """A checkpoint of ~`n_tensors` tiny F32 tensors with Llama names (stresses per-tensor bookkeeping)."""
    shape = tiny_llama_shape(n_tensors)
    specs = [(n, s, "F32") for n, s in shape.tensors()]
    stamp = {"kind": "tiny-tensors", "tensors": len(specs), "shards": shards, "version": 2}
    if _stamp_matches(folder, stamp):
        return stamp
    _fresh(folder)
    write_sharded(folder, specs, shards, lambda info: np.full(info.numel, 0.5, np.float32))
    (folder / "config.json").write_text(json.dumps(shape.hf_config(), indent=2))
    (folder / STAMP).write_text(json.dumps(stamp))
    return stamp


def main(argv: list[str] | None = None) -> None:
    """Command-line entry: write one benchmark input."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=["synth", "hf", "tiny"])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--size-gib", type=float, default=2.0)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--tensors", type=int, default=100_000)
    parser.add_argument("--dtype", choices=["F32", "BF16"], default="F32", help="synth only: the stored dtype")
    args = parser.parse_args(argv)
    if args.kind == "synth":
        stamp = make_synthetic_llama(args.folder, args.size_gib, args.shards, dtype=args.dtype)
    elif args.kind == "hf":
        stamp = make_transformers_llama(args.folder)
    else:
        stamp = make_tiny_tensors(args.folder, args.tensors)
    print(json.dumps(stamp))


if __name__ == "__main__":
    main()
