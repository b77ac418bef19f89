"""Streamed pieces (`mapper.pieces`, `engine.pieces`): experts dequantised then stacked are computed, written and
freed one expert at a time; the plan counts one piece, and a real run's peak RSS stays within the prediction."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import load_file, save_file  # noqa: E402

import workbench as wb  # noqa: E402
from tests.conftest import run_cli_measured  # noqa: E402
from workbench import mapper as M  # noqa: E402
from workbench.mapper.pieces import output_pieces  # noqa: E402

MIB = 1 << 20
EXPERTS, ROWS, COLS, BLOCK = 64, 1024, 1024, 128  # each expert: 1 MiB of FP8, 2 MiB once dequantised to bf16
PREFIX = "model.layers.0.mlp.experts"


@pytest.fixture(scope="module")
def fp8_experts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("fp8_experts")
    gen = torch.Generator().manual_seed(7)
    tensors = {}
    for e in range(EXPERTS):
        tensors[f"{PREFIX}.{e}.down_proj.weight"] = torch.randn(ROWS, COLS, generator=gen).to(torch.float8_e4m3fn)
        tensors[f"{PREFIX}.{e}.down_proj.weight_scale_inv"] = torch.rand(ROWS // BLOCK, COLS // BLOCK, generator=gen)
    save_file(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK]}}))
    return folder


def _recipe(folder: Path) -> M.Mapper:
    return M.Sequential(M.presets.dequantize_fp8(folder), M.Stack([f"{PREFIX}.{{e*}}.down_proj.weight"], f"{PREFIX}.down_proj"))


def test_the_plan_holds_one_expert_not_the_stack(fp8_experts: Path) -> None:
    plan = wb.plan(fp8_experts, _recipe(fp8_experts))
    assert plan.ok, plan.problems
    (step,) = plan.steps
    assert step.kind == "pieces" and step.bytes_out == EXPERTS * 2 * MIB
    one_expert = MIB + (ROWS // BLOCK) * (COLS // BLOCK) * 4 + 2 * MIB  # FP8 in, its scales, bf16 out
    assert step.held_bytes == one_expert == plan.peak_bytes  # was inputs + output: 64 + 128 MiB
    assert "(piece by piece)" in plan._repr_html_()


def test_pieces_written_at_their_byte_ranges_equal_the_whole_computation(fp8_experts: Path, tmp_path: Path) -> None:
    report = wb.convert(fp8_experts, tmp_path / "out", _recipe(fp8_experts), quiet=True, verify=True)
    assert report.verified and list(report.verification["status"]) == ["ok"]  # re-computed piece by piece
    got = load_file(tmp_path / "out" / "model.safetensors")[f"{PREFIX}.down_proj"]
    source = load_file(fp8_experts / "model.safetensors")
    for e in (0, 1, EXPERTS - 1):
        weight, scale = source[f"{PREFIX}.{e}.down_proj.weight"], source[f"{PREFIX}.{e}.down_proj.weight_scale_inv"]
        expected = (weight.float() * scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)).to(torch.bfloat16)
        assert torch.equal(got[e].view(torch.int16), expected.view(torch.int16)), e


def test_a_concatenation_along_dim_1_of_stacks_is_cut_into_expert_rows(fp8_experts: Path) -> None:
    """gate_up as transformers 5 holds it: two stacks joined along dim 1, cut into one piece per expert."""
    source = wb.open_checkpoint(fp8_experts)
    names = [f"{PREFIX}.{e}.down_proj.weight" for e in range(4)]
    mapper = M.Sequential(M.Stack(names[:2], "gate"), M.Stack(names[2:], "up"), M.Concat(["gate", "up"], "gate_up", dim=1))
    (group,) = [g for g in mapper.bind(source, rest="drop").groups if g.outputs]
    plan_group = type(group)(group.inputs, group.outputs, group.op)  # computed, not a byte recipe
    pieces = output_pieces(plan_group)
    assert pieces is not None and [p.rows for p in pieces.pieces] == [1, 1]
    assert [sorted(p.sources()) for p in pieces.pieces] == [sorted(names[0::2]), sorted(names[1::2])]


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc to read a process's peak RSS")
def test_a_real_run_peaks_within_the_prediction(fp8_experts: Path, tmp_path: Path) -> None:
    mapper_file = tmp_path / "recipe.py"
    mapper_file.write_text(_recipe(fp8_experts).to_code())
    plan = wb.plan(fp8_experts, _recipe(fp8_experts))
    _, measured = run_cli_measured(["convert", str(fp8_experts), str(tmp_path / "out"), "--mapper", str(mapper_file)])
    whole = EXPERTS * 3 * MIB  # what computing the stack at once held (inputs + output)
    assert measured <= plan.rss_bytes * 1.15, (measured, plan.rss_bytes)
    assert plan.rss_bytes - plan.peak_bytes + whole > measured + 100 * MIB  # far below a run holding the stack


def test_two_ranks_write_the_same_bytes(fp8_experts: Path, tmp_path: Path) -> None:
    """Two stacks of 4 experts on two ranks: each rank streams its own pieces; the output is byte-identical to one rank's."""
    names = [f"{PREFIX}.{e}.down_proj.weight" for e in range(EXPERTS)]
    mapper = M.Sequential(M.presets.dequantize_fp8(fp8_experts), M.Stack(names[:4], "a"), M.Stack(names[4:8], "b"),
                          M.Parallel(*[M.Drop(name) for name in names[8:]]))
    one = wb.convert(fp8_experts, tmp_path / "one", mapper, shard_size="9MB", quiet=True)
    wb.convert(fp8_experts, tmp_path / "two", mapper, shard_size="9MB", nproc=2, quiet=True)
    assert one.predicted_peak_bytes == 3 * MIB + (ROWS // BLOCK) * (COLS // BLOCK) * 4
    files = sorted(p.name for p in (tmp_path / "one").glob("*.safetensors"))
    assert len(files) == 2 and files == sorted(p.name for p in (tmp_path / "two").glob("*.safetensors"))
    assert all((tmp_path / "one" / f).read_bytes() == (tmp_path / "two" / f).read_bytes() for f in files)


def test_a_cast_after_a_stack_is_cast_piece_by_piece(fp8_experts: Path, tmp_path: Path) -> None:
    """Stack then Cast (e.g. a dtype change of stacked experts): each expert is dequantised, cast and written alone."""
    names = f"{PREFIX}.{{e*}}.down_proj.weight"
    mapper = M.Sequential(M.presets.dequantize_fp8(fp8_experts), M.Stack([names], "stacked"), M.Cast("stacked", "f32"))
    plan = wb.plan(fp8_experts, mapper)
    (step,) = plan.steps
    assert step.kind == "pieces" and step.bytes_out == EXPERTS * 4 * MIB
    assert step.held_bytes == MIB + (ROWS // BLOCK) * (COLS // BLOCK) * 4 + 2 * MIB + 4 * MIB  # in, scales, bf16, f32
    wb.convert(fp8_experts, tmp_path / "out", mapper, quiet=True)
    got = load_file(tmp_path / "out" / "model.safetensors")["stacked"]
    whole = wb.convert(fp8_experts, tmp_path / "ref", _recipe(fp8_experts), quiet=True)
    assert whole.ok
    expected = load_file(tmp_path / "ref" / "model.safetensors")[f"{PREFIX}.down_proj"].float()
    assert got.dtype == torch.float32 and torch.equal(got, expected)


@pytest.mark.parametrize("how", ["concat-of-casts", "cast-of-concat", "dtype-policy"])
def test_a_concatenation_along_columns_is_written_by_row_blocks_equal_to_torch_cat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str,
) -> None:
    from workbench.mapper import pieces as pieces_module

    monkeypatch.setattr(pieces_module, "ROW_BLOCK_BYTES", 32 << 10)  # many blocks, the last one short
    gen = torch.Generator().manual_seed(3)
    tensors = {"a": torch.randn(1001, 40, generator=gen), "b": torch.randn(1001, 13, generator=gen) * 1e3,
               "c": torch.randn(1001, 7, generator=gen).double()}
    save_file(tensors, tmp_path / "model.safetensors")
    cast_first, dtype = how == "concat-of-casts", "bf16" if how == "dtype-policy" else None
    if cast_first:
        mapper = M.Sequential(*(M.Cast(n, "bf16") for n in "abc"), M.Concat(["a", "b", "c"], "abc", dim=1))
    elif dtype:  # `dtype=` casts the concatenation's output (`planning.dtype_policy.CastOutputs`)
        mapper = M.Sequential(M.Cast("c", "F32"), M.Concat(["a", "b", "c"], "abc", dim=1))
    else:
        mapper = M.Sequential(M.Cast("c", "F32"), M.Concat(["a", "b", "c"], "abc", dim=1), M.Cast("abc", "bf16"))
    plan = wb.plan(tmp_path, mapper, dtype=dtype)
    (step,) = plan.steps
    pieces = output_pieces(step.group)
    assert step.kind == "pieces" and pieces.row_blocks and len(pieces.pieces) > 12
    assert sum(p.rows for p in pieces.pieces) == 1001 and step.held_bytes <= 32 << 10
    report = wb.convert(tmp_path, tmp_path / "out", mapper, dtype=dtype, quiet=True, verify=True)
    assert report.verified and list(report.verification["status"]) == ["ok"]  # re-computed block by block
    got = load_file(tmp_path / "out" / "model.safetensors")["abc"]
    if cast_first:
        expected = torch.cat([tensors[n].to(torch.bfloat16) for n in "abc"], dim=1)
    else:
        expected = torch.cat([tensors["a"], tensors["b"], tensors["c"].float()], dim=1).to(torch.bfloat16)
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))


def test_rows_of_a_source_not_raw_on_disk_are_not_cut_into_blocks() -> None:
    from workbench.catalog import TensorInfo
    from workbench.mapper.groups import Group
    from workbench.planning.schedule import step_kind

    class Unlocated:  # a source whose tensors the reader assembles: no byte range to read rows from
        def located(self, info: TensorInfo) -> bool:
            return False

    a, b = TensorInfo("a", "F32", (4096, 1024)), TensorInfo("b", "F32", (4096, 512))
    op = M.Sequential(M.Concat(["a", "b"], "ab", dim=1), M.Cast("ab", "bf16"))
    group = Group((a, b), (TensorInfo("ab", "BF16", (4096, 1536)),), op)
    assert output_pieces(group).row_blocks
    assert step_kind(group, Unlocated()) == "compute"
