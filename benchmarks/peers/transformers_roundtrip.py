"""Peer: transformers `from_pretrained` + `save_pretrained`, the way most people re-save a checkpoint.

Loads the whole model into memory (so peak RSS grows with model size), then saves it sharded at 5 GB.
`--dtype bf16` loads in bfloat16, which is transformers' cast. Runs offline (HF_HUB_OFFLINE=1).
save_pretrained does not fsync: run.py syncs the outputs and counts that time.
"""

from __future__ import annotations

import os
import time

from _common import parser, versions, write_result


def main() -> None:
    """Load SRC as a model and save it to DST."""
    p = parser(__doc__)
    p.add_argument("--dtype", choices=["keep", "bf16"], default="keep")
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

    import torch
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.source, dtype=dtype)
    loaded = time.perf_counter()
    model.save_pretrained(args.dest, max_shard_size="5GB")
    end = time.perf_counter()
    write_result(
        args.result, work_s=end - start, fsynced=False,
        notes=f"{versions('transformers')}; load {loaded - start:.1f} s, save {end - loaded:.1f} s",
    )


if __name__ == "__main__":
    main()
