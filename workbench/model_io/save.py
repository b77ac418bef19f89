"""`wb.save_from(model, dest, mapper)`: write a module's state as an HF safetensors checkpoint.

Every rank describes its state keys; merged, they form the catalog of the whole model, which the
planner binds and lays out exactly as for a conversion, so the files are byte-identical to a
single-process save whatever the number of ranks. Then all ranks walk the same schedule: for each
group, the canonical holders of each input gather it (a DTensor's `full_tensor()`, tensor by
tensor), it is sent to the rank that writes the group's file if that rank does not hold it, and
the writer writes it. Rank 0 writes the index last, once every rank has committed its files.
A rank that fails keeps taking part in the exchanges, so no rank is left waiting.
"""

from __future__ import annotations

import os
import time
from typing import Any

from ..api_types import Rest
from ..engine.finalize import finalize_destination, prepare_destination, remove_partials
from ..engine.memory import HeldBytes, reset_rss_peak, rss_bytes, rss_peak_bytes
from ..engine.progress import ProgressCallback
from ..engine.report import RankResult, RunReport
from ..engine.status import describe_failure
from ..errors import PlanError
from ..iostats import IO
from ..mapper.base import Mapper
from ..mapper.groups import Group
from ..module_state import StateEntry, module_state
from ..output.safetensors import INDEX_NAME, SafetensorsWriter
from ..overflow import OverflowCounts, attributed, collect
from ..planning.build import DEFAULT_CHUNK, build_plan, make_options
from ..planning.model import Plan
from .comm import Comm, stage_of
from .holdings import Holdings, merge, publish
from .local_part import local_tensor
from .progress import rank_progress
from .save_plan import assign_writers, input_route, predicted_peak


class SaveReport(RunReport):
    """A save's report: predicted next to measured, per rank (see RunReport)."""

    def summary(self) -> str:
        """Text report: status line, predicted vs measured, per-rank lines."""
        lines = super().summary().split("\n")
        if self.ok:
            lines[0] = f"Saved into {self.dest} in {self.seconds:.2f}s ({len(self.files)} files, {self.nproc} rank(s))"
        return "\n".join(lines)


class StepRunner:
    """One rank's side of the save schedule: obtain inputs, write the groups it owns, commit its files."""

    def __init__(self, plan: Plan, holdings: Holdings, state: dict[str, StateEntry], comm: Comm) -> None:
        self.plan = plan
        self.holdings = holdings
        self.state = state
        self.comm = comm
        self.held = HeldBytes()
        self.files = {f.name: f for f in plan.rank_files(comm.rank)}
        self.writers: dict[str, SafetensorsWriter] = {}
        self.written: list[str] = []
        self.done = 0
        self.failure: str | None = None
        self.overflow = OverflowCounts()  # values a cast (dtype=...) could not hold, per output tensor

    def obtain(self, info: Any, writer: int) -> tuple[Any, int]:
        """(the input whole on the writer, else None; bytes this rank holds for it)."""
        key, rank = info.name, self.comm.rank
        gathers, sender = input_route(key, writer, self.holdings)
        if not gathers:
            return (local_tensor(self.state[key].tensor) if rank == writer else None), 0
        whole, held = None, 0
        if rank in self.holdings.source_group[key]:
            tensor = self.state[key].tensor
            if self.holdings.sharded[key]:
                whole, held = tensor.full_tensor().detach(), info.nbytes
            else:
                whole = tensor.detach()
        if sender is None:
            return (whole if rank == writer else None), held
        if rank == sender:
            self.comm.send(whole, writer)
        if rank == writer:
            return self.comm.recv(info, sender), info.nbytes
        return None, held

    def _writer_of(self, name: str) -> tuple[SafetensorsWriter, int] | None:
        file, begin = self.plan.placement[name]
        if file not in self.files or self.files[file].kept:
            return None
        writer = self.writers.get(file)
        if writer is None:
            assert self.plan.dest is not None
            writer = self.writers[file] = SafetensorsWriter(self.plan.dest, self.files[file].layout)
        return writer, begin

    def write(self, group: Group, inputs: dict[str, Any]) -> None:
        """Write a group's outputs: byte-level groups as slices of their inputs' bytes, others computed."""
        import torch

        if group.recipe is not None:
            views: dict[str, memoryview] = {}
            for out in group.outputs:
                target = self._writer_of(out.name)
                if target is None:
                    continue
                at = 0
                for piece in group.recipe[out.name]:
                    if piece.length:
                        view = views.get(piece.source)
                        if view is None:
                            flat = inputs[piece.source].cpu().contiguous().reshape(-1)
                            view = views[piece.source] = memoryview(flat.view(torch.uint8).numpy())
                        target[0].write(out.name, view[piece.begin : piece.end], at)
                    at += piece.length
                self.done += at
            return
        with collect() as found:
            results = group.apply(inputs)
        self.overflow.merge(attributed(found, [t.name for t in group.outputs], group.label))
        self.held.hold(group.bytes_out)
        try:
            for out in group.outputs:
                target = self._writer_of(out.name)
                if target is not None:
                    target[0].write_tensor(out.name, results[out.name])
                    self.done += out.nbytes
        finally:
            self.held.release(group.bytes_out)

    def commit_finished(self, step_index: int, last_step: dict[str, int]) -> None:
        """Commit the files whose last step this was."""
        for name in list(self.writers):
            if last_step.get(name) == step_index:
                self.writers.pop(name).commit(sync_dir=False)
                self.written.append(name)

    def fail(self, exc: BaseException) -> None:
        """Remember the first failure, drop the open files, keep exchanging with the other ranks."""
        if self.failure is None:
            self.failure = describe_failure(exc)
        for writer in self.writers.values():
            writer.abort()
        self.writers.clear()

    def run(self, progress: Any) -> None:
        """Walk every step of the schedule (all ranks do, in the same order)."""
        import torch

        steps = [s for s in self.plan.steps if self.plan.step_active(s)]
        last_step = {name: s.index for s in steps for name in s.files if name in self.files}
        with torch.no_grad():
            for step in steps:
                writer, group = step.rank, step.group
                inputs: dict[str, Any] = {}
                held = 0
                try:
                    for info in group.inputs:
                        value, n = self.obtain(info, writer)
                        self.held.hold(n)
                        held += n
                        if value is not None:
                            inputs[info.name] = value
                    if writer == self.comm.rank and self.failure is None:
                        try:
                            self.write(group, inputs)
                            self.commit_finished(step.index, last_step)
                            progress.update(self.done)
                        except Exception as exc:  # noqa: BLE001 - reported through the rank's status
                            self.fail(exc)
                finally:
                    self.held.release(held)
        if self.written:
            fd = os.open(self.plan.dest, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _agree_on_plan(comm: Comm, catalog: Any, mapper: Any, options: Any, dest: Any, holdings: Holdings) -> Plan:
    """Rank 0 plans with the destination checks and prepares the folder; every rank ends with the same plan."""
    plan: Plan | None = None
    verdict = None
    if comm.rank == 0:
        try:
            plan = build_plan(catalog, mapper, options, dest)
            for file in plan.output_file_list:  # never resume: the layout says nothing of the values, which change
                file.kept = False
            assign_writers(plan, holdings, comm.world)
            verdict = {"errors": [p.message for p in plan.errors]}
            if plan.ok:
                prepare_destination(plan)
        except Exception as exc:
            verdict = {"errors": [describe_failure(exc)]}
    verdict = comm.broadcast(verdict)
    if verdict["errors"]:
        raise PlanError(f"Cannot save into {dest}: " + " ".join(verdict["errors"]))
    fingerprint = ""
    try:
        if plan is None:
            plan = build_plan(catalog, mapper, options, dest, check_dest=False)
            assign_writers(plan, holdings, comm.world)
        fingerprint = plan.layout_fingerprint + " ".join(str(f.rank) for f in plan.output_file_list)
    except Exception as exc:
        fingerprint = "failed: " + describe_failure(exc)
    everyone = comm.all_gather(fingerprint)
    if len(set(everyone)) != 1:
        odd = next(r for r, fp in enumerate(everyone) if fp != everyone[0])
        raise PlanError(
            f"Cannot save into {dest}: rank {odd} planned a different output than rank 0 "
            f"({everyone[odd][:200] if everyone[odd].startswith('failed') else 'another mapper or model on that rank?'}). "
            "Call save_from with the same model and mapper on every rank."
        )
    assert plan is not None
    return plan


def save_from(
    model: Any,
    dest: str | os.PathLike,
    mapper: Mapper | None = None,
    *,
    shard_size: int | str = "5GB",
    dtype: Any = None,
    rest: Rest = "keep",
    mesh: Any = None,
    pp_dim: int | str | None = None,
    drop_tied: bool = True,
    overwrite: bool = False,
    quiet: bool = False,
    on_progress: ProgressCallback | None = None,
) -> SaveReport:
    """Save `model`'s state (through `mapper`) into `dest` as HF safetensors shards plus an index.

        report = wb.save_from(model, "out/", shard_size="2GB", dtype="bf16")   # on every rank under torchrun

    Works on a plain module and, under torch.distributed (every rank calls it), on DTensor / FSDP2
    parameters: tensors are gathered one at a time (never the whole model on a rank), each written
    once by one rank, files split across ranks. With a `mesh` and its pipeline dimension `pp_dim`
    (at any position in the mesh), each rank passes its stage's module and the stages are merged
    into one checkpoint. Tied duplicates are written once (under their first name) when `drop_tied`.
    `dtype` stores every floating-point tensor in that dtype. The output bytes equal a
    single-process save of the same model. A folder left by a failed save is rewritten whole (shards
    are never reused: the model's values may have changed). Returns a SaveReport; raises PlanError on every rank
    when any rank fails (no index is written then).
    """
    comm = Comm()
    started = time.perf_counter()
    if pp_dim is not None and mesh is None:
        raise PlanError("Cannot save with pp_dim but no mesh: pass the DeviceMesh the pipeline dimension belongs to.")
    stage = stage_of(mesh, pp_dim, comm.rank) if pp_dim is not None else None
    state = module_state(model)
    on_meta = next((k for k, e in state.items() if getattr(e.tensor, "is_meta", False)), None)
    published = comm.all_gather((stage, publish(state, comm.rank, drop_tied=drop_tied), on_meta))
    for rank, (_, _, meta_key) in enumerate(published):
        if meta_key is not None:
            raise PlanError(
                f"Cannot save {type(model).__name__} into {dest}: {meta_key!r} on rank {rank} is on the meta device (it has "
                "no values). Materialise and initialise or load the model first (model.to_empty(...), wb.load_into).",
                tensor=meta_key,
            )
    holdings = merge([(stage_, records) for stage_, records, _ in published])
    options = make_options(shard_size, comm.world, rest, dtype, False, overwrite, DEFAULT_CHUNK)
    plan = _agree_on_plan(comm, holdings.catalog(type(model).__name__), mapper, options, dest, holdings)

    runner = StepRunner(plan, holdings, state, comm)
    result = RankResult(comm.rank, predicted_peak_bytes=predicted_peak(plan, holdings, comm.rank))
    progress = rank_progress(sum(f.tensor_bytes for f in runner.files.values() if not f.kept), rank=comm.rank,
                             quiet=quiet, callback=on_progress, desc="save")
    reset_rss_peak()
    result.rss_baseline = rss_bytes()
    IO.reset()
    rank_started = time.perf_counter()
    try:
        runner.run(progress)
    except Exception as exc:  # a failure outside the writer's own work (e.g. a gather): still report it
        runner.fail(exc)
    finally:
        try:
            progress.close()
        except Exception as exc:  # noqa: BLE001 - a cancel from the final progress call
            runner.fail(exc)
    result.ok, result.error = runner.failure is None, runner.failure
    result.seconds = time.perf_counter() - rank_started
    result.steps = sum(1 for s in plan.steps if s.rank == comm.rank)
    result.bytes_written = IO.snapshot()["bytes_written"]
    result.files_written = runner.written
    result.peak_tensor_bytes = runner.held.peak
    result.overflow = runner.overflow.counts
    result.rss_peak = rss_peak_bytes()
    results = [RankResult.from_dict(r) for r in comm.all_gather(result.to_dict())]
    outcome = None
    if comm.rank == 0:
        outcome = {"ok": all(r.ok for r in results), "index": False, "error": ""}
        if outcome["ok"]:
            try:
                outcome["index"] = finalize_destination(plan)
            except Exception as exc:
                outcome.update(ok=False, error=describe_failure(exc))
        if not outcome["ok"]:
            remove_partials(plan)
    outcome = comm.broadcast(outcome)
    if not outcome["ok"]:
        causes = [f"rank {r.rank} failed: {(r.error or 'unknown error').rstrip('. ')}" for r in results if not r.ok]
        if outcome["error"]:
            causes.append(f"finishing failed: {outcome['error']}")
        raise PlanError(f"Cannot save into {dest}: {'; '.join(causes)}. No index was written; fix the cause and save again.")
    return SaveReport(
        dest=plan.dest, ranks=results, seconds=time.perf_counter() - started,
        predicted_peak_bytes=max(r.predicted_peak_bytes for r in results), predicted_files=[], predicted_bytes_read=0,
        predicted_bytes_written=plan.bytes_written,
        files=[f.name for f in plan.output_file_list] + ([INDEX_NAME] if outcome["index"] else []),
        kept=sorted(plan.kept), index_written=outcome["index"],
    )
