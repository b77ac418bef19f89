"""Huge checkpoints that cost no disk: real safetensors headers, data regions left as holes.

Opening a checkpoint reads headers only, so a sparse file (header written, the rest `truncate`d into
existence) behaves exactly like a real one for everything but reading values. This builds:

- a Llama-3.1-405B-shaped HF checkpoint (126 layers, hidden 16384, intermediate 53248, 128 heads,
  8 kv heads, vocab 128256, BF16: ~811 GB apparent) in 191 shards plus index, and
- a checkpoint of 100k tiny tensors (per-tensor bookkeeping at scale).

Usage:
    python benchmarks/make_sparse.py llama405b DIR [--layers 126] [--shards 191]
    python benchmarks/make_sparse.py tiny DIR [--tensors 100000] [--shards 4]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, replace
from pathlib import Path

# The Llama names and shapes come from the sibling make_llama_like.py, also when this file is loaded by path.
sys.path.append(str(Path(__file__).resolve().parent))

from make_llama_like import LlamaShape, tiny_llama_shape  # noqa: E402

from workbench.catalog import TensorInfo  # noqa: E402
from workbench.output.safetensors import layout_file, shard_file_name, write_index  # noqa: E402

STAMP = "sparse_input.json"
Spec = tuple[str, tuple[int, ...], str]  # name, shape, dtype code


LLAMA_405B = LlamaShape(hidden=16384, intermediate=53248, heads=128, kv_heads=8, layers=126, vocab=128256)
LLAMA_405B_SHARDS = 191


def _greedy_cuts(sizes: list[int], limit: int) -> list[int]:
    """Start index of each shard when filling shards in key order up to `limit` bytes (a shard closes before overflow)."""
    cuts, used = [0], 0
    for i, size in enumerate(sizes):
        if used and used + size > limit:
            cuts.append(i)
            used = 0
        used += size
    return cuts


def shard_evenly(specs: list[Spec], n_shards: int) -> list[list[TensorInfo]]:
    """Greedy key-order sharding (as the hub helpers do) with the smallest size limit giving `n_shards` files."""
    infos = [TensorInfo(name, dtype, shape) for name, shape, dtype in specs]
    sizes = [t.nbytes for t in infos]
    low, high = max(max(sizes), -(-sum(sizes) // n_shards)), sum(sizes)
    while low < high:  # the shard count only falls as the limit grows
        mid = (low + high) // 2
        if len(_greedy_cuts(sizes, mid)) <= n_shards:
            high = mid
        else:
            low = mid + 1
    cuts = [*_greedy_cuts(sizes, low), len(infos)]
    return [infos[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]


def write_sparse_sharded(folder: Path, shards: list[list[TensorInfo]]) -> int:
    """Write each shard's real header and extend the file to its full size as a hole; returns total tensor bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    total = 0
    n = len(shards)
    for k, infos in enumerate(shards, start=1):
        file = shard_file_name(k, n)
        layout = layout_file(file, infos)
        path = folder / file
        with open(path, "wb") as fh:
            fh.write(layout.header)
        os.truncate(path, layout.size)
        for info in layout.tensors:
            weight_map[info.name] = file
            total += info.nbytes
    if n > 1:
        write_index(folder, weight_map, total)
    return total


def _build(folder: Path, stamp: dict, specs: list[Spec], n_shards: int) -> dict:
    try:
        saved = json.loads((folder / STAMP).read_text())
        if {k: saved.get(k) for k in stamp} == stamp:
            return saved
    except (OSError, ValueError, AttributeError):
        pass
    if folder.exists() and any(folder.iterdir()):
        if not (folder / STAMP).exists():
            raise SystemExit(f"{folder} is not empty and was not made by make_sparse.py: pick another folder.")
        for entry in folder.iterdir():
            if entry.name == STAMP or entry.name.endswith((".safetensors", ".index.json")):
                entry.unlink()
    stamp["bytes"] = write_sparse_sharded(folder, shard_evenly(specs, n_shards))
    stamp["tensors"] = len(specs)
    (folder / STAMP).write_text(json.dumps(stamp))
    return stamp


def make_sparse_llama(folder: Path, shape: LlamaShape = LLAMA_405B, n_shards: int = LLAMA_405B_SHARDS, dtype: str = "BF16") -> dict:
    """Write (or reuse) a sparse HF checkpoint of a Llama `shape`; returns its stamp (with `bytes`, `tensors`)."""
    specs = [(name, s, dtype) for name, s in shape.tensors()]
    stamp = {"kind": "sparse-llama", "shape": asdict(shape), "shards": n_shards, "dtype": dtype}
    return _build(folder, stamp, specs, n_shards)


def make_sparse_tiny(folder: Path, n_tensors: int = 100_000, n_shards: int = 4) -> dict:
    """Write (or reuse) a sparse checkpoint of ~`n_tensors` tiny F32 tensors with Llama names."""
    toy = tiny_llama_shape(n_tensors)
    specs = [(name, s, "F32") for name, s in toy.tensors()]
    stamp = {"kind": "sparse-tiny", "requested": n_tensors, "shards": n_shards}
    return _build(folder, stamp, specs, n_shards)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry: write one sparse checkpoint and print its stamp."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=["llama405b", "tiny"])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--layers", type=int, default=LLAMA_405B.layers)
    parser.add_argument("--shards", type=int, default=None)
    parser.add_argument("--tensors", type=int, default=100_000)
    args = parser.parse_args(argv)
    if args.kind == "llama405b":
        stamp = make_sparse_llama(args.folder, replace(LLAMA_405B, layers=args.layers), args.shards or LLAMA_405B_SHARDS)
    else:
        stamp = make_sparse_tiny(args.folder, args.tensors, args.shards or 4)
    print(json.dumps(stamp))


if __name__ == "__main__":
    main()
