"""Conversions on several processes with torchrun (gloo on CPU): identical bytes, failures, resume, cancel.

Each torchrun start costs seconds, so these tests are few and each checks several things.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import workbench as wb
from tests.conftest import assert_same_folder, process_gone
from workbench.engine import Cancelled
from workbench.errors import PlanError
from workbench.launch import Launch
from workbench.mapper import presets

pytestmark = pytest.mark.distributed

INDEX = "model.safetensors.index.json"
CAST_OPTIONS = {"shard_size": "100KB", "dtype": "bf16"}


def no_partials(folder: Path) -> bool:
    return not [n for n in os.listdir(folder) if n.endswith(".partial")]


@pytest.fixture(scope="module")
def fused_cast_reference(llama_sample: Path, tmp_path_factory) -> Path:
    """Fuse q/k/v and gate/up and cast to bf16 on one process: the bytes every rank count must give."""
    dest = tmp_path_factory.mktemp("reference") / "out"
    report = wb.convert(llama_sample, dest, presets.hf_to_fused(llama_sample / "config.json"), quiet=True, **CAST_OPTIONS)
    assert len([f for f in report.files if f.endswith(".safetensors")]) >= 3
    return dest


@pytest.fixture(scope="module")
def reshard_reference(llama_sample: Path, tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("reshard") / "out"
    wb.convert(llama_sample, dest, shard_size="200KB", quiet=True)
    return dest


def test_three_launched_ranks_give_identical_bytes(llama_sample: Path, tmp_path: Path, fused_cast_reference: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "2")
    progress: list[tuple[int, int, int]] = []
    mapper = presets.hf_to_fused(llama_sample / "config.json")
    report = wb.convert(llama_sample, tmp_path / "out", mapper, nproc=3, quiet=True,
                        on_progress=lambda *event: progress.append(event), **CAST_OPTIONS)
    assert_same_folder(fused_cast_reference, tmp_path / "out")
    assert report.ok and report.nproc == 3 and report.files_match_plan
    plan = wb.plan(llama_sample, mapper, nproc=3, **CAST_OPTIONS)
    for result in report.ranks:  # each rank opened only the source files its own groups need
        assert result.files_opened == plan.source_paths(result.rank)
        assert result.peak_tensor_bytes == plan.rank_peak_bytes(result.rank)
    assert {rank for rank, _, _ in progress} == {0, 1, 2}
    finals = {rank: (done, total) for rank, done, total in progress}
    assert all(done == total for done, total in finals.values())


SCRIPT = r"""
import os
import sys
import workbench as wb
from workbench.mapper import presets

src, dest = sys.argv[1], sys.argv[2]
report = wb.convert(src, dest, presets.hf_to_fused(src + "/config.json"), quiet=True, shard_size="100KB", dtype="bf16")
os.write(1, f"RESULT {report.ok} {report.nproc} {report.files_match_plan} {report.index_written}\n".encode())  # one write
"""


def test_in_place_under_users_torchrun_gives_identical_bytes(llama_sample: Path, tmp_path: Path,
                                                              fused_cast_reference: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONHASHSEED": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
         str(llama_sample), str(tmp_path / "out")],
        capture_output=True, text=True, env=env, timeout=240,
    )
    assert done.returncode == 0, done.stderr[:3000]
    assert done.stdout.count("RESULT True 2 True True") == 2  # both ranks return the same successful report
    assert_same_folder(fused_cast_reference, tmp_path / "out")


def test_failing_rank_leaves_no_index_and_a_resumed_run_completes(llama_sample: Path, tmp_path: Path,
                                                                  reshard_reference: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    dest = tmp_path / "out"
    monkeypatch.setenv("WORKBENCH_FAIL_RANK", "1")
    with pytest.raises(PlanError) as failure:
        wb.convert(llama_sample, dest, shard_size="200KB", nproc=2, quiet=True)
    message = str(failure.value)
    assert "rank 1 failed" in message and "WORKBENCH_FAIL_RANK=1" in message and "No index was written" in message
    assert not (dest / INDEX).exists() and no_partials(dest)
    monkeypatch.delenv("WORKBENCH_FAIL_RANK")
    report = wb.convert(llama_sample, dest, shard_size="200KB", nproc=2, quiet=True)
    assert report.kept  # rank 1 committed its first files before failing; they were kept
    assert report.bytes_written < sum(os.path.getsize(reshard_reference / n) for n in os.listdir(reshard_reference)
                                      if n.endswith(".safetensors"))
    assert_same_folder(reshard_reference, dest)


@pytest.mark.parametrize("launcher", ["torchrun", "local"])
def test_cancel_kills_every_worker_and_commits_nothing(llama_sample: Path, tmp_path: Path, launcher: str) -> None:
    dest = tmp_path / "out"
    plan = wb.plan(llama_sample, dest=dest, dtype="bf16", chunk_size="16B", shard_size="100KB", nproc=2)
    seen: list[int] = []

    def stop(rank: int, done: int, total: int) -> bool:
        seen.append(rank)
        return False

    launch = Launch(plan, quiet=True, on_progress=stop, launcher=launcher).start()
    with pytest.raises(Cancelled, match="cancelled"):
        launch.wait()
    assert seen and launch.worker_pids
    assert all(process_gone(pid) for pid in launch.worker_pids.values())
    assert not (dest / INDEX).exists() and no_partials(dest)
    assert launch.jobdir is not None and not launch.jobdir.exists()
