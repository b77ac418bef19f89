"""`wb.convert(...)`: plan, check, run (here, on torchrun workers, or in place under torchrun), report."""

from __future__ import annotations

import os
import warnings
from typing import Any

from .api_types import CheckpointLike, Launcher, OnOverflow, OutputName, Rest
from .engine.finalize import require_runnable, tidy_spool
from .engine.output_check import check_outputs
from .engine.progress import ProgressCallback, in_jupyter_kernel
from .engine.report import RunReport
from .errors import CastOverflowWarning
from .launch.in_process import run_local
from .launch.inplace import convert_in_place, under_torchrun
from .launch.launchers import check_launcher
from .mapper.base import Mapper
from .mapper.groups import Binding
from .planning.build import DEFAULT_CHUNK, build_plan, make_options
from .planning.model import Plan
from .planning.sources import resolve_catalog

# Inside a Jupyter kernel `wb.convert` shows a RunPanel (per-rank bars, cancel) instead of a text bar.
# Set to False to keep the text bar. The panel is the one front end the orchestrator knows by name.
NOTEBOOK_DISPLAY = True


def notebook_display(plan: Plan, on_progress: ProgressCallback | None = None, launcher: str = "auto") -> Any:
    """The RunPanel that runs `plan` with live per-rank progress in a notebook; None outside a Jupyter
    kernel, when NOTEBOOK_DISPLAY is off, or when ipywidgets is missing."""
    if not NOTEBOOK_DISPLAY or not in_jupyter_kernel():
        return None
    try:
        from .widgets.run_panel import live_display
    except ImportError:
        return None
    return live_display(plan, on_progress, launcher=launcher)


def execute(plan: Plan, *, quiet: bool = False, on_progress: ProgressCallback | None = None, verify: bool = False,
            launcher: Launcher = "auto") -> RunReport:
    """Run an existing plan (made with a destination): here when nproc is 1, else on worker processes.

        plan = wb.plan("llama/", mapper, dest="out/")
        report = execute(plan) if plan.ok else None

    `launcher` starts the workers: "auto" (local), "local" or "torchrun" (see `wb.convert`). `verify=True` re-reads
    every output afterwards and compares it with the source (`report.verification`).
    """
    require_runnable(plan)
    check_launcher(launcher)
    if plan.complete:  # the destination holds this very conversion, finished: re-running it changes nothing
        tidy_spool(plan)  # a remote destination: what a run killed after publishing left locally
        report = RunReport.nothing_to_do(plan)
        if verify:
            report.output_check = check_outputs(plan)
        return report
    display = None if quiet else notebook_display(plan, on_progress, launcher)  # a notebook panel, not the tqdm bar
    if display is not None:
        report = display.run()
    elif plan.nproc == 1:
        report = run_local(plan, quiet=quiet, on_progress=on_progress)
    else:
        from .launch.launcher import launch  # worker processes: their module only where they start

        report = launch(plan, quiet=quiet, on_progress=on_progress, launcher=launcher)
    if verify:
        report.output_check = check_outputs(plan)
    warn_overflow(report)
    return report


def warn_overflow(report: RunReport) -> None:
    """Issue a CastOverflowWarning naming the worst tensors when a cast met values its dtype cannot hold."""
    if report.overflow_warning is not None:
        warnings.warn(report.overflow_warning.removeprefix("warning: "), CastOverflowWarning, stacklevel=3)


def convert(
    source: CheckpointLike,
    dest: str | os.PathLike,
    mapper: Mapper | Binding | None = None,
    *,
    shard_size: int | str | None = None,
    nproc: int = 1,
    rest: Rest = "keep",
    dtype: Any = None,
    extras: bool = True,
    overwrite: bool = False,
    quiet: bool = False,
    on_progress: ProgressCallback | None = None,
    chunk_size: int | str = DEFAULT_CHUNK,
    to: OutputName = "safetensors",
    verify: bool = False,
    launcher: Launcher = "auto",
    on_overflow: OnOverflow = "warn",
    page_align: bool = True,
    nproc_mp: int = 1,
    spool_size: int | str | None = None,
    spool_dir: str | os.PathLike | None = None,
    remote_options: dict | None = None,
) -> RunReport:
    """Convert `source` into HF safetensors shards in `dest`, exactly as `wb.plan` describes.

        report = wb.convert("llama/", "out/", M.presets.hf_to_fused("llama/"), shard_size="2GB", dtype="bf16", verify=True)

    `nproc > 1` starts worker processes on this machine with the torch-free local launcher (the default,
    `launcher="auto"`; they need no process group, so this saves torchrun's start-up of about 1.6 s), or
    with torchrun (`launcher="torchrun"`). Inside a torchrun job each rank does its share in place: that
    is how a multi-node conversion runs (`torchrun --nnodes N ... -m workbench convert SRC DST`).
    An interrupted run resumes when repeated with the same arguments. `on_progress(rank, done_bytes,
    total_bytes)` is called as bytes are written (return False to cancel); `quiet=True` hides the bar.
    `to='dcp'` writes a torch.distributed.checkpoint folder instead of safetensors shards (see `wb.plan`).
    `verify=True` re-reads every output and compares it with the source: bit-exact for byte-level
    operations, equal to a fresh cast for casts; per tensor in `report.verification`, `report.verified`.
    Values a cast cannot represent (fp16 overflows to inf, float8 e4m3 saturates ...) are counted per tensor
    (`report.overflow`, a `CastOverflowWarning`); `on_overflow="error"` fails the run on the first such value
    instead (a `CastOverflowError`, before the index is written). `page_align=False`: minimal headers, byte-identical
    to `safetensors.save_file` (see `wb.plan`).
    `to='pth', nproc_mp=N` writes Meta's `consolidated.00 .. 0{N-1}.pth`, each tensor split along the dim Meta's
    model-parallel layers expect (norms replicated); `to='gguf'` writes llama.cpp's GGUF (see docs/gguf.md).
    `dest` may be `s3://bucket/prefix/` or `hf://org/repo[@revision]`: each file is uploaded from a bounded local
    spool as soon as it is finished (`spool_size`, `spool_dir`, `remote_options`: see `wb.plan`, docs/remote.md).
    Returns a `RunReport` (predicted next to measured); raises `PlanError` when the plan has errors
    or a rank fails (naming the rank and the cause; no index is written then).
    """
    options = make_options(shard_size, nproc, rest, dtype, extras, overwrite, chunk_size, to, on_overflow,
                           page_align=page_align, nproc_mp=nproc_mp, spool_size=spool_size, spool_dir=spool_dir,
                           remote_options=remote_options)
    check_launcher(launcher)
    if under_torchrun():
        report = convert_in_place(source, dest, mapper, options, quiet=quiet, on_progress=on_progress)
        if verify and int(os.environ.get("RANK", "0")) == 0:  # one rank re-reads the whole output
            report.output_check = check_outputs(build_plan(resolve_catalog(source), mapper, options, dest, check_dest=False))
        warn_overflow(report)
        return report
    plan = build_plan(resolve_catalog(source), mapper, options, dest)
    return execute(plan, quiet=quiet, on_progress=on_progress, verify=verify, launcher=launcher)
