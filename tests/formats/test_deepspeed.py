"""DeepSpeed ZeRO 1/2/3 checkpoints made by DeepSpeed itself, compared with its own zero_to_fp32.

The fixtures are committed in tests/fixtures/deepspeed/, made by `scripts/make_deepspeed_fixtures.py` (its own venv
under `.cache/fixtures/`, since deepspeed must not sit in the project venv); `make fixtures` rebuilds them and checks
the rebuild's tensors against the committed ones (tests/system/test_fixtures_committed.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "make_deepspeed_fixtures.py"
RUNS = ["stage1", "stage2", "stage3", "stage2-fp16"]  # fp16: loss-scaled runs, fp16 module weights


@pytest.fixture(scope="module")
def zero_root() -> Path:
    root = Path(subprocess.run([sys.executable, str(SCRIPT), "--print-root"], capture_output=True, text=True, check=True).stdout.strip())
    if not (root / "done").exists():
        if os.environ.get("WB_BUILD_FIXTURES") == "1":
            subprocess.run([sys.executable, str(SCRIPT)], check=True)
        if not (root / "done").exists():
            why = (root / "failed").read_text().strip() if (root / "failed").exists() else "not built yet"
            pytest.skip(f"DeepSpeed fixtures unavailable ({why}); run `python scripts/make_deepspeed_fixtures.py`")
    return root


def run_dir(root: Path, name: str) -> Path:
    """One DeepSpeed run of the fixture set; skips (with the reason) when that run could not be built."""
    if (root / name / "failed").exists():
        pytest.skip(f"DeepSpeed run {name} could not be built: {(root / name / 'failed').read_text().strip()}")
    return root / name


def _reference(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_open_detects_run_and_step_folder(zero_root: Path, stage: int) -> None:
    import workbench as wb

    run = run_dir(zero_root, f"stage{stage}")
    ck = wb.open_checkpoint(run)
    assert ck.format == "deepspeed"
    step = run / (run / "latest").read_text().strip()
    assert wb.open_checkpoint(step).format == "deepspeed"
    ref = _reference(run / "reference.safetensors")
    assert set(ck.tensors.index) == set(ref)
    for name, t in ref.items():
        row = ck.tensors.loc[name]
        assert tuple(row["shape"]) == tuple(t.shape), name


@pytest.mark.parametrize("name", RUNS)
def test_every_tensor_equals_zero_to_fp32(zero_root: Path, name: str) -> None:
    import torch

    from tests.conftest import load_checked
    from workbench.formats.deepspeed import open_deepspeed

    run = run_dir(zero_root, name)
    catalog = open_deepspeed(run)
    ref = _reference(run / "reference.safetensors")
    assert catalog.metadata["zero_stage"] == name[5] and catalog.metadata["world_size"] == "2"
    spanning = 0
    for tensor, want in ref.items():
        got = load_checked(catalog, tensor)
        assert got.dtype == want.dtype, tensor
        assert torch.equal(got.view(torch.uint8) if got.numel() else got, want.view(torch.uint8) if want.numel() else want), tensor
        spanning += "," in str(catalog.columns["ranks"].get(tensor, ""))
    assert spanning > 0  # some parameters really are assembled from both ranks


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_convert_writes_zero_to_fp32_bit_for_bit(zero_root: Path, stage: int, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    import workbench as wb

    run = run_dir(zero_root, f"stage{stage}")
    plan = wb.plan(run, None)
    assert plan.ok, plan.problems
    # Each group reads from the optimizer rank files, never a whole file: the plan names them.
    reads = set(", ".join(plan.groups["reads_from"]).split(", "))
    assert any("zero_pp_rank_0" in r for r in reads) and any("zero_pp_rank_1" in r for r in reads)
    ref_tensors = _reference(run / "reference.safetensors")
    largest = max(t.numel() for t in ref_tensors.values()) * 4
    assert plan.peak_bytes <= 2 * largest  # bounded by the largest tensor, not by the optimizer files
    # Only the weights' byte ranges are read: the moments (twice the masters' size) never are.
    optim_files = sum(f.stat().st_size for f in (run / (run / "latest").read_text().strip()).glob("*optim_states.pt"))
    assert plan.bytes_read == sum(t.numel() * t.element_size() for t in ref_tensors.values()) < optim_files / 2
    wb.convert(run, tmp_path / "out", quiet=True)
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    ref = _reference(run / "reference.safetensors")
    assert set(got) == set(ref)
    for name in ref:
        assert got[name].dtype == ref[name].dtype and torch.equal(got[name].view(torch.uint8), ref[name].view(torch.uint8)), name


def test_converted_weights_load_into_transformers(zero_root: Path, tmp_path: Path) -> None:
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    import workbench as wb

    run = run_dir(zero_root, "stage3")
    assert (run / "config.json").is_file()
    wb.convert(run, tmp_path / "hf", quiet=True)
    (tmp_path / "hf" / "config.json").write_bytes((run / "config.json").read_bytes())
    config = AutoConfig.from_pretrained(tmp_path / "hf")
    model = LlamaForCausalLM.from_pretrained(tmp_path / "hf", config=config, dtype=torch.float32)
    ref = _reference(run / "reference.safetensors")
    state = model.state_dict()
    for name, t in ref.items():
        assert torch.equal(state[name].to(t.dtype), t), name


def test_module_weights_and_moments_are_separate_selections(zero_root: Path) -> None:
    import torch

    from tests.conftest import load_checked
    from workbench.errors import CheckpointError
    from workbench.formats.deepspeed import OPTIM_PREFIX, open_deepspeed

    run = run_dir(zero_root, "stage2")
    fp32 = open_deepspeed(run)
    module = open_deepspeed(run, weights="module")
    assert {module[n].dtype for n in module} == {"BF16"}
    name = "model.layers.1.mlp.up_proj.weight"
    # The bf16 module weight is the fp32 master rounded (DeepSpeed copies masters into the module each step).
    assert torch.equal(load_checked(module, name), load_checked(fp32, name).to(torch.bfloat16))
    assert not any(n.startswith(OPTIM_PREFIX) for n in fp32)
    with_moments = open_deepspeed(run, moments=True)
    avg = load_checked(with_moments, f"{OPTIM_PREFIX}{name}.exp_avg")
    sq = load_checked(with_moments, f"{OPTIM_PREFIX}{name}.exp_avg_sq")
    assert avg.shape == fp32[name].shape and bool((sq >= 0).all()) and bool(avg.abs().sum() > 0)
    with pytest.raises(CheckpointError, match="stage 3 saves no module weights"):
        open_deepspeed(run_dir(zero_root, "stage3"), weights="module")
    half = open_deepspeed(run_dir(zero_root, "stage2-fp16"), weights="module")  # an fp16 run's module weights are fp16
    masters = open_deepspeed(run_dir(zero_root, "stage2-fp16"))
    assert {half[n].dtype for n in half} == {"F16"}
    assert torch.equal(load_checked(half, name), load_checked(masters, name).to(torch.float16))


@pytest.mark.parametrize("name", RUNS)
def test_masters_and_moments_equal_deepspeeds_live_gather(zero_root: Path, name: str) -> None:
    """Adam moments (and masters) equal what DeepSpeed's safe_get_full_optimizer_state gathered in training."""
    import torch

    from tests.conftest import load_checked
    from workbench.formats.deepspeed import open_deepspeed

    run = run_dir(zero_root, name)
    ck = open_deepspeed(run, moments=True)
    live = _reference(run / "live_reference.safetensors")
    assert any(k.endswith(".exp_avg_sq") for k in live)
    for tensor, want in live.items():
        got = load_checked(ck, tensor)
        assert torch.equal(got, want.reshape(got.shape)), tensor


def test_missing_rank_file_is_refused(zero_root: Path, tmp_path: Path) -> None:
    import shutil

    from workbench.errors import CheckpointError
    from workbench.formats.deepspeed import open_deepspeed

    run = run_dir(zero_root, "stage2")
    step = run / (run / "latest").read_text().strip()
    copy = tmp_path / step.name
    shutil.copytree(step, copy)
    next(copy.glob("*zero_pp_rank_1_*optim_states.pt")).unlink()
    with pytest.raises(CheckpointError, match="partitioned over 2 ranks but 1"):
        open_deepspeed(copy)


def test_cli_convert_and_measured_peak_within_plan(zero_root: Path, tmp_path: Path) -> None:
    """`workbench convert run/ out/` (2 ranks) writes zero_to_fp32's tensors; the measured tensor peak stays within the plan."""
    import torch
    from safetensors.torch import load_file

    import workbench as wb
    from workbench.cli import main

    run = run_dir(zero_root, "stage1")
    assert main(["convert", str(run), str(tmp_path / "cli"), "--nproc", "2", "--shard-size", "200KB"]) == 0
    ref = _reference(run / "reference.safetensors")
    got: dict = {}
    for f in (tmp_path / "cli").glob("*.safetensors"):
        got.update(load_file(str(f)))
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    assert (tmp_path / "cli" / "config.json").read_bytes() == (run / "config.json").read_bytes()
    report = wb.convert(run, tmp_path / "api", quiet=True)
    assert 0 < report.peak_tensor_bytes <= report.predicted_peak_bytes


def test_selection_options_reach_the_cli_and_every_worker(zero_root: Path, tmp_path: Path) -> None:
    """--zero-weights / --zero-moments (and open_checkpoint's options) list the same tensors in every worker."""
    import torch
    from safetensors.torch import load_file

    import workbench as wb
    from tests.conftest import load_checked
    from workbench.cli import main
    from workbench.errors import CheckpointError
    from workbench.formats.deepspeed import OPTIM_PREFIX

    run = run_dir(zero_root, "stage2")
    want = wb.open_checkpoint(run, weights="module", moments=True)
    assert want.catalog.open_options == {"weights": "module", "moments": True}
    assert any(n.startswith(OPTIM_PREFIX) for n in want.catalog) and want.catalog["model.norm.weight"].dtype == "BF16"
    out = tmp_path / "cli"
    assert main(["convert", str(run), str(out), "--zero-weights", "module", "--zero-moments", "--nproc", "2",
                 "--launcher", "local", "--shard-size", "300KB", "--quiet"]) == 0
    got: dict = {}
    for f in out.glob("*.safetensors"):
        got.update(load_file(str(f)))
    assert set(got) == set(want.catalog)
    for name in got:
        assert torch.equal(got[name], load_checked(want.catalog, name)), name
    with pytest.raises(CheckpointError, match=r"with colour: it is a deepspeed checkpoint, whose options are: weights, moments"):
        wb.open_checkpoint(run, colour="red")
    with pytest.raises(CheckpointError, match=r"with weights: it is a safetensors checkpoint, whose options are: none"):
        wb.open_checkpoint(out, weights="module")


def test_hostile_tag_and_truncated_rank_file(zero_root: Path, tmp_path: Path) -> None:
    """A `latest` naming a folder outside the run is not followed; a truncated rank file fails with a clear error."""
    import shutil

    import workbench as wb
    from workbench.errors import CheckpointError, WorkbenchError
    from workbench.formats.deepspeed import detect, open_deepspeed

    run = run_dir(zero_root, "stage3")
    step_name = (run / "latest").read_text().strip()
    outside = tmp_path / "outside"
    shutil.copytree(run / step_name, outside / step_name)
    hostile = tmp_path / "run"
    hostile.mkdir()
    (hostile / "latest").write_text(f"../outside/{step_name}")
    assert not detect(hostile)
    with pytest.raises(CheckpointError):
        open_deepspeed(hostile)
    copy = tmp_path / "copy"
    shutil.copytree(run / step_name, copy / step_name)
    (copy / "latest").write_text(step_name)
    victim = next((copy / step_name).glob("*rank_1_*optim_states.pt"))
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    with pytest.raises(WorkbenchError, match="optim_states"):
        wb.open_checkpoint(copy)
