"""How long binding takes as catalogs grow: mapper.bind on synthetic Llama-like catalogs.

Target: a 100k-tensor catalog binds in under 2 s (a peer library needed 294 s to build its mapper for
20k tensors). Run: `.venv/bin/python benchmarks/bench_bind.py [--sizes 10000,100000]`.
"""

from __future__ import annotations

import argparse
import gc
import time

from workbench.catalog import Catalog, TensorInfo
from workbench.mapper import presets

CONFIG = {"num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 4096}
HIDDEN, INTER, KV = 4096, 11008, 8 * 128
LAYER_TENSORS = (
    ("self_attn.q_proj.weight", (HIDDEN, HIDDEN)), ("self_attn.k_proj.weight", (KV, HIDDEN)),
    ("self_attn.v_proj.weight", (KV, HIDDEN)), ("self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
    ("mlp.gate_proj.weight", (INTER, HIDDEN)), ("mlp.up_proj.weight", (INTER, HIDDEN)),
    ("mlp.down_proj.weight", (HIDDEN, INTER)), ("input_layernorm.weight", (HIDDEN,)),
    ("post_attention_layernorm.weight", (HIDDEN,)),
)


def llama_catalog(n_tensors: int, prefix: str = "") -> Catalog:
    """A metadata-only catalog of about `n_tensors` tensors laid out like an HF Llama checkpoint."""
    infos = [TensorInfo(f"{prefix}model.embed_tokens.weight", "BF16", (32000, HIDDEN))]
    for layer in range(max(1, (n_tensors - 3) // len(LAYER_TENSORS))):
        infos += [TensorInfo(f"{prefix}model.layers.{layer}.{name}", "BF16", shape) for name, shape in LAYER_TENSORS]
    infos += [TensorInfo(f"{prefix}model.norm.weight", "BF16", (HIDDEN,)), TensorInfo(f"{prefix}lm_head.weight", "BF16", (32000, HIDDEN))]
    return Catalog.from_infos(infos)


def cases(n: int):
    yield "hf -> fused qkv/gate_up", llama_catalog(n), presets.hf_to_fused(CONFIG)
    yield "hf -> meta (rotary permute)", llama_catalog(n), presets.hf_to_meta(CONFIG)
    yield "hf -> megatron qkv", llama_catalog(n), presets.hf_to_megatron_qkv(CONFIG)
    yield "strip _orig_mod.", llama_catalog(n, "_orig_mod."), presets.strip_prefix("_orig_mod.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,100000", help="comma-separated catalog sizes")
    args = parser.parse_args()
    print(f"{'mapper':<30} {'tensors':>8} {'groups':>8} {'wall s':>8} {'cpu s':>8} {'us/tensor':>10}")
    for n in (int(size) for size in args.sizes.split(",")):
        for label, catalog, mapper in cases(n):
            binding = None
            gc.collect()  # do not let the previous case's garbage weigh on this one
            start, cpu = time.perf_counter(), time.process_time()
            binding = mapper.bind(catalog)
            seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
            assert binding.ok, binding.problems[:3]
            print(f"{label:<30} {len(catalog):>8} {len(binding.groups):>8} {seconds:>8.2f} {cpu:>8.2f} {1e6 * cpu / len(catalog):>10.1f}")


if __name__ == "__main__":
    main()
