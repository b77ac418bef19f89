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
from ..mapper.groups import Binding, ByteSlice, Group
from ..overflow import cast
from . import copy_runs
from .dtype_policy import CastOutputs, kept_warnings, policy_casts, policy_keeps

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

    def __repr__(self) -> str:
        return f"CastRun({len(self.inputs)} tensors -> {self.dtype})"


def cast_run_group(inputs: tuple[TensorInfo, ...], outputs: tuple[TensorInfo, ...], dtype: str,
                   in_sizes: tuple[int, ...], out_sizes: tuple[int, ...], label: str) -> Group:
    """The group converting `inputs` (neighbours in one file, one dtype) to `dtype`."""
    return Group(inputs, outputs, CastRun(inputs, outputs, dtype, in_sizes, out_sizes), None, dtype, label)


def split_cast_run(group: Group, counts: list[int]) -> list[Group]:
    """`group` (a cast run) cut into consecutive runs of `counts` tensors."""
    op = group.op
    assert type(op) is CastRun
    parts = []
    start = 0
    for count in counts:
        end = start + count
        parts.append(cast_run_group(op.inputs[start:end], op.outputs[start:end], op.dtype, op.in_sizes[start:end],
                                    op.out_sizes[start:end], group.label))
        start = end
    return parts


def cast_run_binding(catalog: Catalog, code: str) -> Binding:
    """`passthrough_binding(catalog, code)` in schedule order, with the small casts numpy does in runs.

    The same decisions per tensor: a float the policy casts becomes a chunked cast, anything else a copy (which the
    schedule joins into copy runs), floats the policy cannot cast are kept with a warning.
    """
    from .sources import PassThrough

    label = f"copy -> {code}"
    casts: dict[str, bool] = {}  # source dtype -> cast by the policy
    in_runs: dict[str, bool] = {}  # source dtype -> numpy converts it to `code`
    kept: dict[str, list[str]] = {}  # float dtype the policy cannot cast -> tensor names
    by_file: dict[str, list[TensorInfo]] = {}
    for info in catalog.tensors.values():
        by_file.setdefault(info.file, []).append(info)
    groups: list[Group] = []
    run: list[TensorInfo] = []
    outs: list[TensorInfo] = []
    in_sizes: list[int] = []
    out_sizes: list[int] = []

    def flush() -> None:
        if len(run) > 1:
            groups.append(cast_run_group(tuple(run), tuple(outs), code, tuple(in_sizes), tuple(out_sizes), label))
        elif run:
            name = run[0].name
            groups.append(Group((run[0],), (outs[0],), CastOutputs(PassThrough(name), code, frozenset((name,))), None, code, label))
        run.clear()
        outs.clear()
        in_sizes.clear()
        out_sizes.clear()

    for file in sorted(by_file):
        infos = by_file[file]
        infos.sort(key=_begin)  # stable: tensors at one offset keep catalog order, as the schedule does
        for info in infos:
            dtype = info.dtype
            here = casts.get(dtype)
            if here is None:
                here = casts[dtype] = policy_casts(dtype, code)
                in_runs[dtype] = here and numpy_castable(dtype, code)
                if policy_keeps(dtype, code):
                    kept[dtype] = []
            name = info.name
            if here:
                out = TensorInfo(name, code, info.shape)
                size = info.end - info.begin
                if in_runs[dtype] and size < copy_runs.RUN_TENSOR_BYTES:
                    if run and (run[0].dtype != dtype or len(run) == copy_runs.RUN_TENSORS):
                        flush()
                    run.append(info)
                    outs.append(out)
                    in_sizes.append(size)
                    out_sizes.append(out.nbytes)
                    continue
                flush()
                groups.append(Group((info,), (out,), CastOutputs(PassThrough(name), code, frozenset((name,))), None, code, label))
                continue
            flush()
            if dtype in kept:
                kept[dtype].append(name)
            groups.append(Group((info,), (TensorInfo(name, dtype, info.shape),), PassThrough(name),
                                {name: (ByteSlice(name, 0, info.end - info.begin),)}, None, "copy"))
        flush()
    return Binding(groups, kept_warnings(kept, code))


def run_batches(op: CastRun, out_begin: Mapping[str, int], chunk_bytes: int) -> tuple[tuple[tuple[int, int], ...], int]:
    """The tensors of a cast run the engine converts at once, as [start, end) positions covering the run, and the
    bytes the step holds at its peak: neighbours adjacent in the source and in the output file batched by the
    rules of `planning.cast_batches` (`out_begin`: each output's offset in its file)."""
    from .cast_batches import BATCH_BYTES
    from .schedule import cast_chunk

    spans: list[tuple[int, int]] = []
    peak = 0
    start = None  # the open batch's first position
    held = src_bytes = 0
    src_end = out_end = -1
    src_dtype = op.inputs[0].dtype if op.inputs else ""
    for k, (src, out, n_in, n_out) in enumerate(zip(op.inputs, op.outputs, op.in_sizes, op.out_sizes, strict=True)):
        begin = out_begin[out.name]
        batchable = n_out and n_out * 3 <= BATCH_BYTES
        if (batchable and start is not None and src.begin == src_end and begin == out_end
                and held + n_in + n_out <= BATCH_BYTES and src_bytes + n_in <= chunk_bytes):
            held += n_in + n_out
            src_bytes += n_in
        else:
            if start is not None:
                spans.append((start, k))
                peak = max(peak, held if k - start > 1 else cast_chunk(op.inputs[start].numel, src_dtype, op.dtype, chunk_bytes)[1])
            if batchable and n_in <= chunk_bytes:
                start, held, src_bytes = k, n_in + n_out, n_in
            else:  # converted alone, chunk by chunk
                spans.append((k, k + 1))
                peak = max(peak, cast_chunk(src.numel, src_dtype, op.dtype, chunk_bytes)[1] if src.numel else 0)
                start = None
        src_end, out_end = src.begin + n_in, begin + n_out
    if start is not None:
        n = len(op.inputs)
        spans.append((start, n))
        peak = max(peak, held if n - start > 1 else cast_chunk(op.inputs[start].numel, src_dtype, op.dtype, chunk_bytes)[1])
    return tuple(spans), peak
