"""Contender: the workbench engine, through the public Python API (`wb.plan` + the engine's `execute`).

`wb.convert(src, dst, ...)` is exactly `plan` followed by `execute`; calling the two apart lets the report
show planning time separately (it matters for the 100k-tiny-tensor checkpoint).
  --mode passthrough: no mapper, re-shard at 5 GB;
  --mode fuse: the `hf_to_fused` preset (q/k/v -> qkv_proj, gate/up -> gate_up_proj, dim 0), config.json
               read from the source folder;
  --mode cast: dtype='bf16' (every floating-point output stored as bf16).
  --nproc N --launcher torchrun|local: N worker processes, started by torchrun or by workbench's local launcher.
The engine fsyncs every output file and the folder itself, so the harness adds nothing.
"""

from __future__ import annotations

import resource
import sys
import time

from _common import imported_heavy_modules, parser, write_result


def cpu_seconds() -> float:
    """User + system time of this process and its finished children (the workers)."""
    return sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))


def main() -> None:
    """Plan and run one conversion; record the engine's report (predicted next to measured)."""
    p = parser(__doc__)
    p.add_argument("--mode", choices=["passthrough", "fuse", "cast"], default="passthrough")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--shard-size", default="5GB")
    p.add_argument("--launcher", choices=["torchrun", "local"], default="torchrun")
    args = p.parse_args()

    import workbench as wb
    from workbench.conversion import execute

    start = time.perf_counter()
    cpu_at_start = cpu_seconds()
    mapper = None
    if args.mode == "fuse":
        from workbench.mapper.presets import hf_to_fused

        mapper = hf_to_fused(args.source / "config.json")
    dtype = "bf16" if args.mode == "cast" else None
    plan = wb.plan(args.source, mapper, dest=args.dest, dtype=dtype, nproc=args.nproc, shard_size=args.shard_size)
    planned = time.perf_counter()
    report = execute(plan, quiet=True, launcher=args.launcher)
    end = time.perf_counter()
    cpu_s = cpu_seconds() - cpu_at_start
    # Under torchrun the peak-RSS process is torchrun's agent, which has imported torch.
    under_torchrun = args.nproc > 1 and args.launcher == "torchrun"
    modules = imported_heavy_modules() + (["torch"] if under_torchrun and "torch" not in sys.modules else [])
    write_result(
        args.result,
        modules=modules,
        work_s=end - start,
        plan_s=planned - start,
        convert_s=end - planned,
        tensors=len(plan.binding.outputs),
        fsynced=True,
        predicted_peak_bytes=report.predicted_peak_bytes,
        measured_peak_bytes=report.peak_tensor_bytes,
        cpu_s=cpu_s,
        notes=f"plan {planned - start:.2f} s, run {end - planned:.2f} s, CPU {cpu_s:.2f} s (all processes, after imports); "
              f"engine RSS above start {report.rss_above_baseline / 1e6:.0f} MB",
        report={
            "seconds": report.seconds, "rank_seconds": [r.seconds for r in report.ranks], "nproc": report.nproc, "bytes_read": report.bytes_read,
            "bytes_written": report.bytes_written, "rss_peak": report.rss_peak,
            "rss_above_baseline": report.rss_above_baseline, "files_match_plan": report.files_match_plan,
            "files": report.files,
        },
    )


if __name__ == "__main__":
    main()
