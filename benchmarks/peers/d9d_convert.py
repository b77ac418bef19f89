"""Peer: the `d9d` library's streamed converter (d9d.model_state), on CPU.

The converter is d9d's own pairing of `read_model_state` (reads the safetensors files a mapper needs and
applies the mapper group by group) with `write_model_state_local` (buffers outputs into shards and writes
them with safetensors `save_file`), the mapper built from d9d's leaf mappers:
  --mode passthrough: one ModelStateMapperIdentity per source tensor;
  --mode fuse: ModelStateMapperConcatenateTensors for q/k/v -> qkv_proj and gate/up -> gate_up_proj on dim 0,
               identity for the rest.
Output shards are capped at 5 GB (decimal, like the others). d9d does not fsync: run.py syncs the outputs.
"""

from __future__ import annotations

import json
import re
import time

from _common import parser, versions, write_result

FUSIONS = {  # output suffix -> input suffixes, concatenated along dim 0
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}
LAYER = re.compile(r"^(.*\.layers\.\d+\.)(.+)$")


def source_keys(source) -> list[str]:
    """Every tensor name of an HF folder (index or single file)."""
    index = source / "model.safetensors.index.json"
    if index.exists():
        return sorted(json.loads(index.read_text())["weight_map"])
    from safetensors import safe_open

    with safe_open(str(source / "model.safetensors"), framework="pt") as f:
        return sorted(f.keys())


def build_mapper(keys: list[str], mode: str):
    """d9d's leaf mappers composed in parallel: identity everywhere, plus dim-0 fusion in 'fuse' mode."""
    from d9d.model_state.mapper.compose import ModelStateMapperParallel
    from d9d.model_state.mapper.leaf import ModelStateMapperConcatenateTensors, ModelStateMapperIdentity

    mappers = []
    used: set[str] = set()
    if mode == "fuse":
        key_set = set(keys)
        prefixes = sorted({m.group(1) for k in keys if (m := LAYER.match(k))})
        for prefix in prefixes:
            for out_suffix, in_suffixes in FUSIONS.items():
                inputs = [prefix + s for s in in_suffixes]
                if all(i in key_set for i in inputs):
                    mappers.append(ModelStateMapperConcatenateTensors(inputs, prefix + out_suffix, dim=0))
                    used.update(inputs)
    mappers += [ModelStateMapperIdentity(k) for k in keys if k not in used]
    return ModelStateMapperParallel(mappers)


def main() -> None:
    """Convert SRC to DST with d9d's reader + writer."""
    p = parser(__doc__)
    p.add_argument("--mode", choices=["passthrough", "fuse"], default="passthrough")
    args = p.parse_args()

    from d9d.model_state.io import read_model_state, write_model_state_local
    from d9d.model_state.mapper.adapters import identity_mapper_from_mapper_outputs

    start = time.perf_counter()
    mapper = build_mapper(source_keys(args.source), args.mode)
    built = time.perf_counter()
    states = read_model_state(args.source, mapper, device="cpu", show_progress=False)
    write_model_state_local(
        args.dest, identity_mapper_from_mapper_outputs(mapper), states,
        shard_size_gb=5e9 / 2**30, show_progress=False,
    )
    end = time.perf_counter()
    write_result(
        args.result, work_s=end - start, fsynced=False,
        notes=f"{versions('d9d')}; mapper build {built - start:.2f} s",
    )


if __name__ == "__main__":
    main()
