"""Peer: the naive conversion everyone writes first, `safetensors` load_file + save_file one shard at a time.

Keeps the source's sharding and names; `--dtype bf16` casts every floating tensor on the way.
Does not fsync (run.py syncs the outputs and counts that time, for the same durability as the others).
"""

from __future__ import annotations

import json
import shutil
import time

from _common import parser, versions, write_result


def main() -> None:
    """Convert SRC to DST shard by shard through whole-shard tensors in memory."""
    p = parser(__doc__)
    p.add_argument("--dtype", choices=["keep", "bf16"], default="keep")
    args = p.parse_args()

    import torch
    from safetensors.torch import load_file, save_file

    start = time.perf_counter()
    args.dest.mkdir(parents=True)
    index_path = args.source / "model.safetensors.index.json"
    if index_path.exists():
        index = json.loads(index_path.read_text())
        shards = sorted(set(index["weight_map"].values()))
    else:
        index, shards = None, ["model.safetensors"]
    total = 0
    for shard in shards:
        tensors = load_file(args.source / shard)
        if args.dtype == "bf16":
            tensors = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in tensors.items()}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, args.dest / shard, metadata={"format": "pt"})
        del tensors
    if index is not None:
        index["metadata"]["total_size"] = total
        (args.dest / index_path.name).write_text(json.dumps(index, indent=2))
    for extra in ("config.json", "generation_config.json"):
        if (args.source / extra).exists():
            shutil.copy(args.source / extra, args.dest / extra)
    write_result(args.result, work_s=time.perf_counter() - start, fsynced=False, bytes_out=total, notes=versions("safetensors"))


if __name__ == "__main__":
    main()
