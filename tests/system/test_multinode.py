"""Launch choices: the local launcher by default on one machine, per-rank balance in the report, and a
two-node torchrun job (two agents on this machine, c10d rendezvous on 127.0.0.1) writing one destination.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from remote_servers import torchrun_nodes
from safetensors.numpy import save_file

import workbench as wb
from tests.conftest import assert_same_folder

pytestmark = pytest.mark.distributed

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def balanced_source(tmp_path_factory) -> Path:
    """Eight equal float32 tensors in four equal shards: an even split exists."""
    folder = tmp_path_factory.mktemp("balanced")
    rng = np.random.default_rng(5)
    tensors = {f"layers.{i}.weight": rng.standard_normal((64, 256), dtype=np.float32) for i in range(8)}
    for shard in range(4):
        names = [f"layers.{2 * shard}.weight", f"layers.{2 * shard + 1}.weight"]
        save_file({n: tensors[n] for n in names}, str(folder / f"model-{shard:05d}-of-00004.safetensors"))
    return folder


def test_nproc_above_one_uses_the_local_launcher_and_reports_rank_balance(balanced_source: Path, tmp_path: Path) -> None:
    one = wb.convert(balanced_source, tmp_path / "one", shard_size="70KB", dtype="bf16", quiet=True)
    two = wb.convert(balanced_source, tmp_path / "two", shard_size="70KB", dtype="bf16", nproc=2, quiet=True)
    assert one.launcher == "in process" and two.launcher == "local"
    assert_same_folder(tmp_path / "one", tmp_path / "two")
    written = [r.bytes_written for r in two.ranks]
    assert len(written) == 2 and min(written) > 0
    assert two.rank_balance["bytes"] == max(written) / min(written) <= 1.10
    summary = two.summary()
    assert "ranks started by: local" in summary and "rank balance (largest / smallest rank): bytes written" in summary


def test_explicit_torchrun_launcher_is_reported(balanced_source: Path, tmp_path: Path) -> None:
    report = wb.convert(balanced_source, tmp_path / "out", shard_size="70KB", nproc=2, quiet=True, launcher="torchrun")
    assert report.launcher == "torchrun" and report.ok


def _agents(source: Path, dest: Path, env: dict[str, str]) -> list[subprocess.CompletedProcess]:
    """Two torchrun agents, one rank each, that meet through a c10d rendezvous on 127.0.0.1."""
    return torchrun_nodes(["-m", "workbench", "convert", str(source), str(dest), "--shard-size", "70KB", "--dtype", "bf16",
                           "--quiet"], [env, env])


def test_two_torchrun_nodes_write_one_destination_like_one_process(balanced_source: Path, tmp_path: Path) -> None:
    reference = tmp_path / "one"
    wb.convert(balanced_source, reference, shard_size="70KB", dtype="bf16", quiet=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORKBENCH_FAIL_RANK", None)
    agents = _agents(balanced_source, tmp_path / "nodes", env)
    for agent in agents:
        assert agent.returncode == 0, agent.stderr[-3000:]
    assert_same_folder(reference, tmp_path / "nodes")

    failing = tmp_path / "failing"
    agents = _agents(balanced_source, failing, {**env, "WORKBENCH_FAIL_RANK": "1"})
    assert all(agent.returncode != 0 for agent in agents)
    assert any("rank 1 failed" in agent.stderr for agent in agents), [a.stderr[-2000:] for a in agents]
    assert not (failing / INDEX).exists()
    assert not [n for n in os.listdir(failing) if n.endswith(".partial")]
