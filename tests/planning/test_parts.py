"""Parts (`planning.parts`, `planning.ranks.share_ranks`): when whole files leave ranks out of balance, ranks share
files, each writing a contiguous byte range of a tensor (experts, row chunks, byte slices), one committer renaming
the file. The output is byte-identical to one rank's and the largest / smallest rank's bytes written is <= 1.10."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import save_file  # noqa: E402

import workbench as wb  # noqa: E402
from workbench import mapper as M  # noqa: E402
from workbench.planning.ranks import BALANCE, written_spread  # noqa: E402

EXPERTS, ROWS, COLS, BLOCK = 32, 128, 128, 128  # an expert: 32 KiB in bf16, a stack 1 MiB
PREFIX = "model.layers.0.mlp.experts"


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One layer of FP8 experts with block scales, bf16 experts and an MXFP4 stacked tensor (gpt-oss names)."""
    folder = tmp_path_factory.mktemp("parts_moe")
    gen = torch.Generator().manual_seed(11)
    tensors = {}
    for e in range(EXPERTS):
        tensors[f"{PREFIX}.{e}.down_proj.weight"] = torch.randn(ROWS, COLS, generator=gen).to(torch.float8_e4m3fn)
        tensors[f"{PREFIX}.{e}.down_proj.weight_scale_inv"] = torch.rand(ROWS // BLOCK, COLS // BLOCK, generator=gen)
        tensors[f"{PREFIX}.{e}.up_proj.weight"] = torch.randn(ROWS, COLS, generator=gen).to(torch.bfloat16)
    tensors["model.layers.1.mlp.experts.gate_up_proj_blocks"] = torch.randint(0, 256, (EXPERTS, 96, 4, 16), generator=gen, dtype=torch.uint8)
    tensors["model.layers.1.mlp.experts.gate_up_proj_scales"] = torch.randint(118, 130, (EXPERTS, 96, 4), generator=gen, dtype=torch.uint8)
    save_file(tensors, folder / "model.safetensors")
    quant = {"quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK]}
    (folder / "config.json").write_text(json.dumps({"quantization_config": quant}))
    return folder


def _recipe(folder: Path) -> M.Mapper:
    """Three stacks of one layer: dequantised FP8 experts (PIECES), bf16 experts (a byte COPY), MXFP4 (ROWS)."""
    return M.Sequential(
        M.presets.dequantize_fp8(folder),
        M.presets.dequantize_mxfp4({"quantization_config": {"quant_method": "mxfp4"}}, wb.open_checkpoint(folder)),
        M.Stack([f"{PREFIX}.{{e*}}.down_proj.weight"], f"{PREFIX}.down_proj"),
        M.Stack([f"{PREFIX}.{{e*}}.up_proj.weight"], f"{PREFIX}.up_proj"),
    )


OPTIONS = {"chunk_size": "64KB", "shard_size": "5GB"}  # small chunks: row chunks and byte units smaller than a rank's share


def test_ranks_share_the_one_file_each_a_byte_range_of_each_kind(moe: Path) -> None:
    plan = wb.plan(moe, _recipe(moe), nproc=4, **OPTIONS)
    assert plan.ok, plan.problems
    (file,) = plan.output_file_list
    assert file.ranks == (0, 1, 2, 3) and not plan.warnings
    assert written_spread(plan.steps, 4) <= BALANCE
    kinds = {step.kind for step in plan.steps if step.part is not None}
    assert kinds == {"pieces", "copy", "rows"}
    for name in plan.outputs.index:  # each output's parts tile it, in order, with no gap or overlap
        parts = [s.part for s in plan.steps if s.group.outputs[0].name == name]
        ends = [0] + [end for _, end in parts]
        assert [begin for begin, _ in parts] == ends[:-1] and ends[-1] == plan.outputs.loc[name, "nbytes"]
    whole = wb.plan(moe, _recipe(moe), nproc=1, **OPTIONS)
    assert plan.peak_bytes <= whole.peak_bytes  # a part holds at most what its whole step held


def test_shared_files_are_byte_identical_to_one_rank_and_balanced(moe: Path, tmp_path: Path) -> None:
    one = wb.convert(moe, tmp_path / "one", _recipe(moe), quiet=True, **OPTIONS)
    four = wb.convert(moe, tmp_path / "four", _recipe(moe), nproc=4, quiet=True, verify=True, **OPTIONS)
    assert one.ok and four.ok and four.verified and set(four.verification["status"]) == {"ok"}
    assert (tmp_path / "one" / "model.safetensors").read_bytes() == (tmp_path / "four" / "model.safetensors").read_bytes()
    assert four.rank_balance["bytes"] <= BALANCE
    assert four.files_match_plan
    assert not list((tmp_path / "four").glob("*.partial"))


def test_a_format_that_cannot_share_keeps_whole_files(moe: Path) -> None:
    """DCP writes one file per rank of its own: nothing is cut, whatever the balance."""
    plan = wb.plan(moe, _recipe(moe), nproc=4, to="dcp", **OPTIONS)
    assert all(step.part is None for step in plan.steps) and not any(f.ranks for f in plan.output_file_list)


def test_a_failing_rank_leaves_no_shared_file_and_the_run_again_completes(moe: Path, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from workbench.engine.rank import FAIL_RANK_ENV
    from workbench.errors import PlanError

    dest = tmp_path / "out"
    monkeypatch.setenv(FAIL_RANK_ENV, "2")  # rank 2 fails just before releasing its last range of the shared file
    with pytest.raises(PlanError, match="rank 2"):
        wb.convert(moe, dest, _recipe(moe), nproc=4, quiet=True, **OPTIONS)
    assert not list(dest.glob("*.safetensors")) and not list(dest.glob("*.partial"))
    monkeypatch.delenv(FAIL_RANK_ENV)
    report = wb.convert(moe, dest, _recipe(moe), nproc=4, quiet=True, **OPTIONS)
    assert report.ok and [p.name for p in dest.glob("*.safetensors")] == ["model.safetensors"]
