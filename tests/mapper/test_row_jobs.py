"""Row jobs are a capability any operation may offer (`mapper.row_jobs`): the planner makes a `rows` step of a group
whose op offers one and the engine runs it a chunk of rows at a time, neither knowing what the job makes. Here a
toy op (every value doubled, float32) offers one; GGUF's `to_gguf` is the other (tests/test_gguf_*)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file

import workbench as wb
from workbench import mapper as M
from workbench.catalog import TensorInfo
from workbench.mapper.row_jobs import row_job
from workbench.planning.schedule import ROWS

TENSOR = "model.embed_tokens.weight"  # F32 (256, 64) in the tiny Llama
CHUNKS: list[int] = []  # rows of each chunk the converter was handed, in order


def double(tensor: Any) -> Any:
    """The op on whole tensors (what torch would run without the row job)."""
    return tensor * 2


def infer_double(info: TensorInfo) -> list[tuple[str, tuple[int, ...]]]:
    return [(info.dtype, tuple(info.shape))]


@dataclass(frozen=True)
class DoubleRows:
    """A row job doubling float32 rows, 16 rows a chunk whatever the budget."""

    inputs: tuple[TensorInfo, ...]
    output: TensorInfo
    overflow_dtype: str = "F32"
    value_dtype: str | None = "F32"
    libraries: tuple[str, ...] = ()
    library_bytes: int = 0
    library_detail: str = ""

    @property
    def rows(self) -> int:
        return self.inputs[0].shape[0]

    @property
    def in_row(self) -> int:
        return 4 * self.inputs[0].shape[1]

    @property
    def out_row(self) -> int:
        return self.in_row

    def whole(self, k: int) -> tuple[TensorInfo, ...]:
        return ()

    def budget(self, chunk_bytes: int) -> int:
        return chunk_bytes

    def chunk_rows(self, budget: int) -> int:
        return 16

    def held(self, rows: int) -> int:
        return 2 * rows * self.in_row

    def held_bytes(self, chunk_bytes: int) -> int:
        return self.held(self.chunk_rows(self.budget(chunk_bytes)))

    def converter(self, rows: int):
        def convert(k: int, first: int, raw: Any, whole: Any) -> tuple[Any, int, float]:
            values = np.frombuffer(raw, np.float32)
            CHUNKS.append(values.size // self.inputs[0].shape[1])
            return (values * 2).view(np.uint8), 0, 0.0

        return convert


def offer(op: Any, group: Any, ahead: tuple[Any, ...] = ()) -> DoubleRows | None:
    return None if ahead else DoubleRows(tuple(group.inputs), group.outputs[0])


double.rows = offer  # type: ignore[attr-defined]


def test_an_op_offering_rows_is_planned_and_run_by_rows_without_naming_a_format(llama_sample: Path, tmp_path: Path) -> None:
    op = M.Function(f"{__name__}:double", (TENSOR,), ("doubled",), infer=f"{__name__}:infer_double")
    plan = wb.plan(llama_sample, op, dest=tmp_path / "out")
    (step,) = [s for s in plan.steps if s.group.outputs[0].name == "doubled"]
    assert step.kind == ROWS and step.held_bytes == 2 * 16 * 256 and isinstance(row_job(step.group), DoubleRows)
    CHUNKS.clear()
    report = wb.convert(llama_sample, tmp_path / "out", op, quiet=True, verify=True)
    assert CHUNKS[:16] == [16] * 16 and report.ok
    checked = {row[0]: row for row in report.output_check.rows}
    assert checked["doubled"][1:3] == ("compute", "ok") and CHUNKS[16:] == [16] * 16  # --verify ran the job again
    written = {}
    for file in (tmp_path / "out").glob("*.safetensors"):
        written.update(load_file(file))
    source = wb.open_checkpoint(llama_sample).catalog
    expected = np.frombuffer(source.read_bytes(TENSOR), np.float32).reshape(256, 64) * 2
    assert np.array_equal(written["doubled"], expected)


def test_an_op_ahead_of_it_or_a_function_without_rows_makes_no_row_step(llama_sample: Path) -> None:
    op = M.Function(f"{__name__}:double", (TENSOR,), ("doubled",), infer=f"{__name__}:infer_double")
    ahead = M.Sequential(M.Cast(TENSOR, "F32"), op)
    plain = M.Function(f"{__name__}:infer_double", (TENSOR,), ("doubled",), infer=f"{__name__}:infer_double")
    for mapper in (ahead, plain):
        plan = wb.plan(llama_sample, mapper, dest="/tmp/unused")
        assert {s.group.outputs[0].name: s.kind for s in plan.steps}["doubled"] != ROWS
