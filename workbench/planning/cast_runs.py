"""Cast runs: neighbouring small casts of one file, planned and run as one group (what copy runs are for copies).

With `dtype=` and no mapper, a checkpoint of 100k tiny float32 tensors is 100k casts. When a safetensors output is
made from enough tensors that lie raw in their files (`copy_runs.many_raw`), the planner puts up to `RUN_TENSORS`
small neighbours of one file (schedule order) that numpy converts from one dtype to the policy's in one group
(`CastRun`). The layout places them one by one and cuts a run where it crosses into the next output file, as for
copy runs; after the layout, `run_batches` marks which neighbours the engine converts at once, by the rules of
`planning.cast_batches`. Batching never changes the bytes (see there), so the files are the ones one group per
tensor gives. Batches end at a run's edges, where batches across steps of one tensor each do not, so the peak
memory can differ from a plan of one step per tensor, within the same bound (`BATCH_BYTES`, or one tensor's
chunked cast); the plan predicts the run's own peak exactly.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

from ..catalog import Catalog, TensorInfo
from ..dtypes import numpy_castable
from ..mapper.groups import Binding, Group
from ..overflow import cast
from . import copy_runs
from .sources import PolicyGroups

_name = operator.attrgetter("name")
_begin = operator.attrgetter("begin")


class CastRun:
    """The op of a cast run: each input converted to `dtype` under its own name.

    `inputs` lie in one source file in file order and share one dtype; `outputs` are the same tensors in `dtype`;
    `in_sizes` / `out_sizes` are their byte sizes.
    """

    def __init__(self, inputs: tuple[TensorInfo, ...], outputs: tuple[TensorInfo, ...], dtype: str,
                 in_sizes: tuple[int, ...], out_sizes: tuple[int, ...]) -> None:
        self.inputs = inputs
        self.outputs = outputs
        self.dtype = dtype
        self.in_sizes = in_sizes
        self.out_sizes = out_sizes

    def apply(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """The inputs converted to `dtype`."""
        return {t.name: cast(tensors[t.name], self.dtype, t.name) for t in self.inputs}

    def text(self) -> str:
        """What the plan fingerprint hashes: the source file and dtype, every tensor's name and source bytes."""
        inputs = self.inputs
        return (f"casts {inputs[0].file} {inputs[0].dtype}->{self.dtype} " + "\0".join(map(_name, inputs)) + " "
                + ",".join(map(str, map(_begin, inputs))) + " " + ",".join(map(str, self.in_sizes)))

    def part(self, start: int, end: int, label: str) -> Group:
        """The group of tensors [start, end) of this run, labelled `label` (a run cut where it crosses into the
        next output file)."""
        return cast_run_group(self.inputs[start:end], self.outputs[start:end], self.dtype, self.in_sizes[start:end],
                              self.out_sizes[start:end], label)

    def __repr__(self) -> str:
        return f"CastRun({len(self.inputs)} tensors -> {self.dtype})"


def cast_run_group(inputs: tuple[TensorInfo, ...], outputs: tuple[TensorInfo, ...], dtype: str,
                   in_sizes: tuple[int, ...], out_sizes: tuple[int, ...], label: str) -> Group:
    """The group converting `inputs` (neighbours in one file, one dtype) to `dtype`."""
    return Group(inputs, outputs, CastRun(inputs, outputs, dtype, in_sizes, out_sizes), None, dtype, label)


def cast_run_binding(catalog: Catalog, code: str) -> Binding:
    """`passthrough_binding(catalog, code)` in schedule order, with the small casts numpy does in runs.

    The same decisions per tensor (`sources.PolicyGroups`): a float the policy casts becomes a chunked cast,
    anything else a copy (which the schedule joins into copy runs), floats the policy cannot cast are kept with a
    warning.
    """
    policy = PolicyGroups(code)

    def key(info: TensorInfo) -> str | None:  # casts numpy does, small enough for a run: joined by source dtype
        dtype = info.dtype
        runs = policy.casts(dtype) and numpy_castable(dtype, code) and info.end - info.begin < copy_runs.RUN_TENSOR_BYTES
        return dtype if runs else None

    groups: list[Group] = []
    for infos in copy_runs.schedule_order(catalog):
        for part in copy_runs.stretches(infos, key):
            if len(part) == 1:
                groups.append(policy.group(part[0]))
                continue
            outputs = tuple(TensorInfo(t.name, code, t.shape) for t in part)
            groups.append(cast_run_group(tuple(part), outputs, code, tuple(t.end - t.begin for t in part),
                                         tuple(t.nbytes for t in outputs), policy.label))
    return policy.binding(groups)


def run_batches(op: CastRun, out_begin: Mapping[str, int], chunk_bytes: int) -> tuple[tuple[tuple[int, int], ...], int]:
    """The tensors of a cast run the engine converts at once, as [start, end) positions covering the run, and the
    bytes the step holds at its peak: neighbours adjacent in the source and in the output file batched by the
    rules of `planning.cast_batches` (`out_begin`: each output's offset in its file)."""
    from .cast_batches import batchable, joins
    from .schedule import cast_chunk

    spans: list[tuple[int, int]] = []
    peak = 0
    start: int | None = None  # the open batch's first position
    held = src_bytes = 0
    src_end = out_end = -1
    src_dtype = op.inputs[0].dtype if op.inputs else ""

    def close(end: int) -> None:  # the open batch ends before `end`; one tensor alone is cast chunk by chunk
        nonlocal peak
        spans.append((start, end))  # type: ignore[arg-type]
        peak = max(peak, held if end - start > 1 else cast_chunk(op.inputs[start].numel, src_dtype, op.dtype, chunk_bytes)[1])  # type: ignore[operator,index]

    for k, (src, out, n_in, n_out) in enumerate(zip(op.inputs, op.outputs, op.in_sizes, op.out_sizes, strict=True)):
        begin = out_begin[out.name]
        small = batchable(n_out)
        if small and start is not None and src.begin == src_end and begin == out_end and joins(held, src_bytes, n_in, n_out, chunk_bytes):
            held += n_in + n_out
            src_bytes += n_in
        else:
            if start is not None:
                close(k)
            start, held, src_bytes = k, n_in + n_out, n_in
            if not (small and n_in <= chunk_bytes):  # converted alone, chunk by chunk
                close(k + 1)
                start = None
        src_end, out_end = src.begin + n_in, begin + n_out
    if start is not None:
        close(len(op.inputs))
    return tuple(spans), peak
