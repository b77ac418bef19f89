"""Predicted process memory (RSS) of each rank of a plan: what a machine must provision, not only tensor bytes.

A conversion process's resident memory is the sum of parts that are each either measured once
(`planning.rss_calibration`, re-measured by `scripts/calibrate_rss.py`) or known from the plan:

    interpreter   a bare CPython process
    workbench     the modules the entry point imports (the CLI for one process, the worker for several)
                  and the small state every run keeps (progress, the I/O ledger)
    imports       the libraries this rank's steps import: none for byte copies, numpy for casts it can
                  do (float32 -> bfloat16 ...), numpy with what their kernels import for row jobs
                  (`mapper.row_jobs`: each job says its libraries and their measured bytes), torch for
                  tensor ops and other casts
    (format)      what the output format adds (`OutputFormat.memory_terms`), e.g. a vocabulary read at planning
    metadata      the catalog and the plan, in proportion to the number of source tensors
    buffers       the remote reader's prefetch window for URL sources, the output headers
    tensor peak   the plan's own peak of tensor bytes (cast arena, inputs and outputs of a compute step)
    intermediates what torch makes on the way in a compute step: an op followed by a cast (a fusion with
                  `dtype=`) first builds the op's result in the input dtype, then the cast output

A library's resident pages depend on the page cache: a page fault maps the whole folio it hits, and where the
cache uses large folios (ext4 on Linux >= 6.16, xfs) a shared object written or read in large chunks (a pip
install, a copy) sits in folios of up to 2 MiB, while one the loader paged in by faults sits in small ones: torch
then maps ~90 MiB more. The constants are measured in the larger state (`scripts/calibrate_rss.py`), a bound to
provision.

The prediction is for a fresh process (`workbench convert` or a worker); inside a notebook the
kernel's own memory comes on top. A numpy cast falls back to torch for a chunk holding NaN, which
imports torch there: data the plan cannot see, so the numpy-only prediction is then low by torch's share.
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from weakref import WeakKeyDictionary

from ..dtypes import numpy_castable
from . import rss_calibration as calibrated
from .schedule import CAST, COMPUTE, COPY, ROWS, Step

if TYPE_CHECKING:  # pragma: no cover
    from ..mapper.row_jobs import RowJob
    from .model import Plan

NONE, NUMPY, TORCH = "none", "numpy", "torch"
CLI, WORKER = "cli", "worker"
# A plan does not change once built: each rank's parts are worked out once (a panel asks for them several times,
# and on a 100k-tensor plan one pass over the steps takes a tenth of a second).
_PARTS: WeakKeyDictionary[Plan, dict[int, list[RssPart]]] = WeakKeyDictionary()
_LIBRARIES: WeakKeyDictionary[Plan, dict[int, str]] = WeakKeyDictionary()


@dataclass(frozen=True)
class RssPart:
    """One row of a rank's predicted RSS: what it is, its bytes, and where the number comes from."""

    part: str
    bytes: int
    detail: str


def rank_libraries(plan: Plan, rank: int) -> str:
    """The heaviest library `rank`'s steps import: 'torch', 'numpy' or 'none' (as engine.steps.preload_libraries does)."""
    per_rank = _LIBRARIES.setdefault(plan, {})
    if rank not in per_rank:
        per_rank[rank] = _libraries(plan, rank)
    return per_rank[rank]


def _libraries(plan: Plan, rank: int) -> str:
    return libraries_for(plan, plan.rank_steps(rank))


def libraries_for(plan: Plan, steps: list[Step]) -> str:
    """The heaviest library `steps` import: 'torch' for tensor ops and casts numpy does not do, 'numpy' when every
    cast is one numpy does on raw bytes (float32 -> bfloat16 ...) and for row jobs, 'none' for byte
    copies alone. The engine
    imports exactly this before measuring its baseline (`engine.steps.preload_libraries`)."""
    reader = plan.source.reader
    found = NONE
    for step in steps:
        if step.kind == COPY:
            continue
        if step.kind == ROWS:  # row jobs run with numpy (and the libraries each job names: `row_libraries`)
            found = NUMPY
            continue
        if step.kind == CAST:
            src, out = step.group.inputs[0], step.group.outputs[0]
            if numpy_castable(src.dtype, out.dtype) and reader is not None and reader.locate(src) is not None:
                found = NUMPY
                continue
        return TORCH
    return found


def row_jobs(steps: list[Step]) -> list[RowJob]:
    """The row jobs (`mapper.row_jobs`) of the ROWS steps among `steps`."""
    if not any(step.kind == ROWS for step in steps):
        return []
    from ..mapper.row_jobs import row_job

    return [job for step in steps if step.kind == ROWS and (job := row_job(step.group)) is not None]


def row_libraries(steps: list[Step]) -> list[str]:
    """The modules the row jobs among `steps` import beyond numpy, each once, in order of first use."""
    return list(dict.fromkeys(module for job in row_jobs(steps) for module in job.libraries))


def calibration_mismatch() -> str | None:
    """Which measured version differs from the installed one ('torch 2.13.0+cpu, installed 2.14.0'), or None:
    the constants then hold for another build, and `scripts/calibrate_rss.py --write` re-measures them."""
    for name, measured in getattr(calibrated, "MEASURED_WITH", {}).items():
        installed = sys.version.split()[0] if name == "python" else installed_version(name)
        if installed is not None and installed != measured:
            return f"{name} {measured}, installed {installed}"
    return None


@functools.cache
def _calibration_mismatch() -> str | None:
    return calibration_mismatch()


def installed_version(name: str) -> str | None:
    """The installed version of distribution `name`, or None when it is not installed.

    Read from the name of its `NAME-VERSION.dist-info` folder on sys.path (as pip installs it), which costs a
    directory listing; `importlib.metadata`, the fallback for other layouts, costs ~30 ms of imports and scanning
    in every `workbench convert` process."""
    prefix = name.lower().replace("-", "_") + "-"
    for entry in sys.path:
        if not entry or not os.path.isdir(entry):
            continue
        try:
            names = os.listdir(entry)
        except OSError:
            continue
        for folder in names:
            if folder.endswith(".dist-info") and folder.lower().startswith(prefix):
                return folder[len(prefix) : -len(".dist-info")]
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def entry_point(plan: Plan) -> str:
    """Which process runs a rank: the CLI (or script) itself for one process, a worker for several."""
    return CLI if plan.nproc == 1 else WORKER


# What the transport of a remote source adds to a process (import and set-up), by scheme: fsspec's HTTP file system
# and aiohttp; huggingface_hub on top for the Hub; s3fs, aiobotocore and botocore for S3. Measured by
# scripts/calibrate_rss.py (in the page-cache state that maps the most of their shared objects).
REMOTE_LIBRARIES = calibrated.REMOTE_LIBRARIES


# What building a recipe from transformers' registry (`M.presets.from_transformers`) leaves resident in the process
# that built it, on top of torch: transformers and its conversion modules (measured by scripts/calibrate_rss.py on a
# scaled-down DeepSeek-V3). Counted for one process (the CLI plans and runs in the same process); workers re-plan
# from the exported recipe and never import it.
TRANSFORMERS_BYTES = calibrated.TRANSFORMERS_BYTES


def built_with_transformers(plan: Plan) -> bool:
    """True when the plan's recipe was built from transformers' registry in this process (its import stays)."""
    return "from_transformers" in (plan.mapper_json or "") and "transformers" in sys.modules


def remote_scheme(plan: Plan) -> str | None:
    """'http', 'hf' or 's3' for a remote source (which transport it loads), None for local files."""
    url = plan.source.url
    if not url:
        return None
    return "s3" if url.startswith("s3://") else "http" if url.startswith(("http://", "https://")) else "hf"


# What each of the reader's fetching threads holds beyond the window while it downloads (its allocator arena, the
# client's buffers): measured as the RSS over the replayed window of pass-through runs from nginx and from a Python
# HTTP server (16 tensors of 10 MiB: +11.0 MiB; an odd-shaped 0.33 GiB Llama: +11.6 MiB; 4 threads), rounded up: the
# remote test requires the prediction not to fall below the measured peak, and a clean clone's run measured 0.7 MiB
# more than 3 MB per thread gave.
CONNECTION_BYTES = 3_400_000


def row_library_bytes(job: Any) -> int:
    """What a row job's libraries add to a process on top of numpy: ml_dtypes alone is calibrated
    (`rss_calibration.ML_DTYPES_BYTES`, measured by scripts/calibrate_rss.py); other libraries, as the job states."""
    return (calibrated.ML_DTYPES_BYTES if tuple(job.libraries) == ("ml_dtypes",) else 0) + job.library_bytes


def prefetch_bytes(plan: Plan, rank: int) -> int:
    """The remote reader's buffers for a URL source beyond the rank's tensor peak; 0 for local files (read straight
    into tensor buffers).

    Worked out by replaying the reader on the rank's reads (`formats.remote_safetensors`): ranges are submitted
    while less than its window is ahead of the consumer, so the window holds up to the window plus the last range
    submitted (a large tensor is one range); a range the consumer takes whole is handed over (counted once), a
    tensor cut from a coalesced range is a copy held beside it. The largest of (window + what the step holds)
    over the steps, plus `CONNECTION_BYTES` per fetching thread, less the tensor peak the prediction counts anyway."""
    if not plan.source.url:
        return 0
    return max(0, remote_peak_bytes(plan, rank) - plan.rank_peak_bytes(rank))


def remote_peak_bytes(plan: Plan, rank: int) -> int:
    """Bytes a remote source's reader and the steps of `rank` hold at most together (see `prefetch_bytes`)."""
    from ..formats.remote_safetensors import PARALLEL, WINDOW_BYTES, chunk_ranges

    steps = plan.rank_steps(rank)
    chunks = chunk_ranges(info for step in steps for info in step.group.inputs)
    chunk_of = {name: i for i, chunk in enumerate(chunks) for name in chunk.names}
    left = [chunk.left for chunk in chunks]
    submitted = ahead = peak = 0
    for step in steps:
        taken = 0  # input bytes the consumer holds in this step (handed-over ranges and copies)
        for info in step.group.inputs:
            index = chunk_of.pop(info.name, None)
            if index is not None:
                while submitted < len(chunks) and (submitted <= index or ahead < WINDOW_BYTES):
                    ahead += chunks[submitted].end - chunks[submitted].start
                    submitted += 1
                left[index] -= 1
                if left[index] == 0:
                    ahead -= chunks[index].end - chunks[index].start
            taken += info.nbytes
            peak = max(peak, ahead + taken)
        inputs = sum(info.nbytes for info in step.group.inputs)
        peak = max(peak, ahead + taken + max(0, step.held_bytes - inputs))
    return peak + (PARALLEL * CONNECTION_BYTES if chunks else 0)


def direct_write_bytes(plan: Plan, rank: int) -> int:
    """The buffers of the engine's direct writes (`output.direct_io`), as much of them as the rank's byte copies
    fill: only where the destination's filesystem takes O_DIRECT and the copies are long enough to use them."""
    from ..output import direct_io

    copied = sum(s.bytes_out for s in plan.rank_steps(rank) if s.kind == COPY)
    if copied < direct_io.MIN_RUN or plan.dest is None or not direct_io.supported(str(plan.dest)):
        return 0
    return min(direct_io.pool_bytes(), -(-copied // direct_io.PAGE) * direct_io.PAGE)


def lane_buffer_bytes(plan: Plan, rank: int) -> int:
    """The copy buffer of each copy lane beyond the first (`planning.lanes`): each lane writes through its own."""
    from ..output.safetensors import WRITE_CALL_MAX
    from .lanes import rank_lanes

    lanes = rank_lanes(plan, rank)
    return 0 if lanes is None else (len(lanes) - 1) * WRITE_CALL_MAX


def rss_parts(plan: Plan, rank: int) -> list[RssPart]:
    """The predicted RSS of `rank`, part by part (they add up to `rank_rss_bytes`)."""
    per_rank = _PARTS.setdefault(plan, {})
    if rank not in per_rank:
        per_rank[rank] = _parts(plan, rank)
    return list(per_rank[rank])


def _parts(plan: Plan, rank: int) -> list[RssPart]:
    entry = entry_point(plan)
    libraries = rank_libraries(plan, rank)
    tensors = len(plan.source)
    prefetch = prefetch_bytes(plan, rank)
    headers = sum(len(f.layout.header) for f in plan.rank_files(rank))
    mismatch = _calibration_mismatch()
    measured = "measured" if mismatch is None else f"measured with {mismatch}: re-run scripts/calibrate_rss.py"
    parts = [
        RssPart("interpreter", calibrated.INTERPRETER, f"a bare python process ({measured})"),
        RssPart("workbench", calibrated.WORKBENCH[entry],
                f"modules the {'workbench convert command' if entry == CLI else 'worker'} imports ({measured})"),
    ]
    if libraries == NONE:
        parts.append(RssPart("imports", 0, "none: byte copies need neither numpy nor torch"))
    elif libraries == NUMPY and (jobs := row_jobs(plan.rank_steps(rank))):
        heaviest = max(jobs, key=row_library_bytes)
        parts.append(RssPart("imports", calibrated.LIBRARY[NUMPY] + row_library_bytes(heaviest),
                             f"numpy ({measured}), {heaviest.library_detail}, torch is not imported"))
    elif libraries == NUMPY:
        parts.append(RssPart("imports", calibrated.LIBRARY[NUMPY], f"numpy: casts numpy does, torch is not imported ({measured})"))
    else:
        spread = getattr(calibrated, "LIBRARY_SPREAD", {}).get(TORCH, 0)
        parts.append(RssPart("imports", calibrated.LIBRARY[TORCH],
                             f"torch: tensor ops or casts numpy does not do ({measured}; up to {spread / 2**20:.0f} MiB less "
                             "when the kernel paged torch's files in by faults rather than writing or reading them whole)"))
    if entry == CLI and built_with_transformers(plan):
        parts.append(RssPart("recipe", TRANSFORMERS_BYTES, "transformers, imported to build the recipe "
                             "(M.presets.from_transformers), stays resident in the process that built it (measured)"))
    scheme = remote_scheme(plan)
    if scheme is not None:
        parts.append(RssPart("transport", REMOTE_LIBRARIES[scheme],
                             f"the {scheme} transport's libraries (fsspec, aiohttp{', huggingface_hub' if scheme == 'hf' else ''}"
                             f"{', s3fs, botocore' if scheme == 's3' else ''}; measured)"))
    for part, size, detail in plan.output_format.memory_terms(planned_here=entry == CLI):
        parts.append(RssPart(part, size, detail))
    if plan.remote is not None:  # a remote destination: its transport (unless the source loaded it) and upload buffers
        dest_scheme = plan.remote.scheme.removesuffix("://")
        if dest_scheme != scheme and dest_scheme in REMOTE_LIBRARIES:
            parts.append(RssPart("transport", REMOTE_LIBRARIES[dest_scheme], f"the {dest_scheme} destination's libraries (measured)"))
        parts += [RssPart(part, size, detail) for part, size, detail in plan.remote.memory_terms()]
    parts.append(RssPart("metadata", calibrated.PER_TENSOR * tensors,
                         f"catalog and plan: {tensors:,} tensors × {calibrated.PER_TENSOR:,} bytes ({measured})"))
    detail = f"output headers {headers:,} bytes"
    if prefetch:
        detail = f"remote prefetch window beyond the tensor peak {prefetch:,} bytes; " + detail
    direct = direct_write_bytes(plan, rank)
    if direct:
        detail += f"; direct-write buffers {direct:,} bytes"
    lane_buffers = lane_buffer_bytes(plan, rank)
    if lane_buffers:
        detail += f"; a second copy lane's buffer {lane_buffers:,} bytes"
    parts.append(RssPart("buffers", prefetch + headers + direct + lane_buffers, detail))
    peak = plan.rank_peak_bytes(rank)
    parts.append(RssPart("tensor peak", peak, _peak_detail(plan, rank)))
    with_intermediates = max((s.held_bytes + intermediate_bytes(s) for s in plan.rank_steps(rank)), default=0)
    parts.append(RssPart("intermediates", max(0, with_intermediates - peak),
                         "an op's result before its cast (compute steps that also cast)"))
    return parts


def intermediate_bytes(step: Step) -> int:
    """Bytes torch builds in a compute step beyond its inputs and outputs: when an op is followed by the plan's cast
    (`dtype=`: the group's op is a `CastOutputs`), its result exists before the cast output is made, in the input
    dtype for a layout op (concat, stack, split, transpose, reshape), in the output's size for a function (a
    dequantisation computes its own dtype). An op alone (a Cast, a function) makes its output directly: nothing."""
    if step.kind != COMPUTE or not step.group.inputs:
        return 0
    from ..dtypes import nbytes_of
    from ..mapper.ops import Cast, _Cut, _Join, _Rewrite
    from .dtype_policy import CastOutputs

    op = step.group.op
    if not isinstance(op, CastOutputs) or isinstance(op.op, Cast):
        return 0
    layout = isinstance(op.op, (_Join, _Cut, _Rewrite))
    source_dtype = step.group.inputs[0].dtype
    cast = [t for t in step.group.outputs if t.name in op.names]
    return sum(nbytes_of(source_dtype, t.numel) if layout else t.nbytes for t in cast)


def _peak_detail(plan: Plan, rank: int) -> str:
    step = peak_step(plan, rank)
    if step is None or not step.held_bytes:
        return "byte copies only: no tensor data held"
    names = ", ".join(t.name for t in step.group.outputs[:2]) + (" ..." if len(step.group.outputs) > 2 else "")
    return f"step {step.index} ({step.kind}: {names})"


def peak_step(plan: Plan, rank: int | None = None):
    """The step holding the most tensor bytes (of `rank`, or of any rank); the first such in schedule order."""
    best = None
    ranks = range(plan.nproc) if rank is None else (rank,)
    for r in ranks:
        for step in plan.rank_steps(r):
            if best is None or step.held_bytes > best.held_bytes:
                best = step
    return best



def rank_rss_bytes(plan: Plan, rank: int) -> int:
    """Predicted peak RSS of the process running `rank`."""
    return sum(p.bytes for p in rss_parts(plan, rank))


__all__ = ["RssPart", "calibration_mismatch", "entry_point", "intermediate_bytes", "peak_step", "prefetch_bytes", "rank_libraries", "remote_peak_bytes", "rank_rss_bytes", "rss_parts"]
