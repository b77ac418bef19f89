"""The torch-free local launcher (`launcher="local"`): torchrun's bytes, failures and cancel, no torch.

The workers need no process group, so on one machine they can start without torchrun. A fake `torch`
package that refuses to import proves that neither the launcher nor the workers import it for a
float32 -> bfloat16 cast (numpy's work).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import workbench as wb
from tests.conftest import assert_same_folder, process_gone
from workbench.errors import PlanError
from workbench.launch import Launch
from workbench.mapper import presets

pytestmark = pytest.mark.distributed

INDEX = "model.safetensors.index.json"
OPTIONS = {"shard_size": "100KB", "dtype": "bf16"}


def leftovers(folder: Path) -> list[str]:
    return [n for n in os.listdir(folder) if n.endswith(".partial") or n == INDEX]


@pytest.fixture(scope="module")
def one_process(llama_sample: Path, tmp_path_factory) -> Path:
    """The fused bf16 conversion on one process: the bytes two local workers must give."""
    dest = tmp_path_factory.mktemp("reference") / "out"
    wb.convert(llama_sample, dest, presets.hf_to_fused(llama_sample / "config.json"), quiet=True, **OPTIONS)
    return dest


def test_cli_local_workers_cast_like_one_process_without_importing_torch(llama_sample: Path, tmp_path: Path) -> None:
    wb.convert(llama_sample, tmp_path / "one", quiet=True, **OPTIONS)  # float32 -> bfloat16 casts run on numpy
    poison = tmp_path / "poison" / "torch"
    poison.mkdir(parents=True)
    (poison / "__init__.py").write_text("raise ImportError('torch was imported by a worker that casts on numpy')\n")
    env = {**os.environ, "PYTHONPATH": str(poison.parent), "PYTHONHASHSEED": "3"}
    done = subprocess.run(
        [sys.executable, "-m", "workbench", "convert", str(llama_sample), str(tmp_path / "two"), "--shard-size",
         OPTIONS["shard_size"], "--dtype", "bf16", "--nproc", "2", "--launcher", "local", "--quiet"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"^\s+1\s+ok\s", done.stdout, re.M) and not done.stderr  # the report's row for rank 1
    assert_same_folder(tmp_path / "one", tmp_path / "two")


def test_local_workers_report_per_rank_progress_and_the_plans_files(llama_sample: Path, one_process: Path,
                                                                     tmp_path: Path) -> None:
    mapper = presets.hf_to_fused(llama_sample / "config.json")
    plan = wb.plan(llama_sample, mapper, nproc=2, dest=tmp_path / "out", **OPTIONS)
    progress: list[tuple[int, int, int]] = []
    report = Launch(plan, quiet=True, launcher="local",
                    on_progress=lambda *event: progress.append(event)).start().wait()
    assert report.ok and report.nproc == 2 and report.files_match_plan and report.index_written
    for result in report.ranks:
        assert result.files_opened == plan.source_paths(result.rank)
    finals = {rank: (done, total) for rank, done, total in progress}
    assert sorted(finals) == [0, 1] and all(done == total > 0 for done, total in finals.values())
    assert_same_folder(one_process, tmp_path / "out")


def test_a_failing_local_rank_leaves_no_index_and_a_resumed_run_completes(
        llama_sample: Path, one_process: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dest = tmp_path / "out"
    mapper = presets.hf_to_fused(llama_sample / "config.json")
    monkeypatch.setenv("WORKBENCH_FAIL_RANK", "1")
    with pytest.raises(PlanError) as failure:
        wb.convert(llama_sample, dest, mapper, nproc=2, quiet=True, launcher="local", **OPTIONS)
    message = str(failure.value)
    assert "rank 1 failed" in message and "WORKBENCH_FAIL_RANK=1" in message and "No index was written" in message
    assert not leftovers(dest)
    monkeypatch.delenv("WORKBENCH_FAIL_RANK")
    report = wb.convert(llama_sample, dest, mapper, nproc=2, quiet=True, launcher="local", **OPTIONS)
    assert report.ok and report.kept
    assert_same_folder(one_process, dest)


def test_a_killed_local_worker_stops_the_others_and_names_the_rank(llama_sample: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    dest = tmp_path / "out"
    monkeypatch.setenv("WORKBENCH_KILL_RANK", "1")  # SIGKILL before its last commit: no status, no cleanup
    launch = Launch(wb.plan(llama_sample, dest=dest, **OPTIONS, nproc=2), quiet=True, launcher="local")
    with pytest.raises(PlanError, match=r"rank\(s\) (0, )?1 stopped without reporting \(local exit code 1"):
        launch.start().wait()
    # Rank 0 may be stopped before it reports its pid when the machine is loaded; rank 1 always reported.
    assert 1 in launch.worker_pids and set(launch.worker_pids) <= {0, 1}
    assert all(process_gone(pid) for pid in launch.worker_pids.values())
    assert not leftovers(dest)


def test_an_unknown_launcher_is_refused_before_anything_is_written(llama_sample: Path, tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="unknown launcher 'mpirun'.*'auto'.*'local'.*'torchrun'"):
        wb.convert(llama_sample, tmp_path / "out", nproc=2, quiet=True, launcher="mpirun")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("launcher", ["local", "torchrun"])
def test_workers_find_functions_defined_in_the_mapper_file(launcher: str, llama_sample: Path, tmp_path: Path) -> None:
    from tests.cli.test_convert import check_function_outputs, run_cli, write_function_mapper

    mapper = write_function_mapper(tmp_path / "mappers")
    dest = tmp_path / "out"
    done = run_cli(["convert", str(llama_sample), str(dest), "--mapper", str(mapper), "--nproc", "2",
                    "--launcher", launcher, "--shard-size", "100KB", "--quiet"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    check_function_outputs(llama_sample, dest)
