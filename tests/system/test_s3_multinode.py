"""Two torchrun "nodes" (two agents on this host, c10d rendezvous on 127.0.0.1), each with its own local spool and
no shared output folder, write one moto S3 prefix; rank 0 publishes the index after both ranks reported. The
objects are byte-identical to the one-process local conversion (issue 35 item 4)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from remote_servers import MotoS3, folder_files, s3_server, torchrun_nodes  # noqa: F401 - fixture s3
from safetensors.numpy import save_file

import workbench as wb

pytestmark = pytest.mark.distributed

INDEX = "model.safetensors.index.json"


def _agents(source: Path, url: str, spools: list[Path], env: dict[str, str],
            caches: dict[str, str] | None = None) -> list[subprocess.CompletedProcess]:
    """Two torchrun nodes converting `source` into `url`, each with its own spool folder (and, from `caches`, its own
    WORKBENCH_CACHE)."""
    return torchrun_nodes(["-m", "workbench", "convert", str(source), url, "--shard-size", "70KB", "--dtype", "bf16", "--quiet"],
                          [{**env, "WORKBENCH_SPOOL_DIR": str(spool),
                            **({"WORKBENCH_CACHE": caches[str(spool)]} if caches else {})} for spool in spools])


def test_two_nodes_without_a_shared_folder_write_one_s3_prefix(s3: MotoS3, tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    rng = np.random.default_rng(5)
    tensors = {f"layers.{i}.weight": rng.standard_normal((64, 256), dtype=np.float32) for i in range(8)}
    for shard in range(4):
        names = [f"layers.{2 * shard}.weight", f"layers.{2 * shard + 1}.weight"]
        save_file({n: tensors[n] for n in names}, str(source / f"model-{shard:05d}-of-00004.safetensors"))
    (source / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "float32"}))
    wb.convert(source, tmp_path / "local", shard_size="70KB", dtype="bf16", quiet=True)
    reference = folder_files(tmp_path / "local")

    bucket = s3.bucket()
    env = {**os.environ, **s3.env, "OMP_NUM_THREADS": "1", "WORKBENCH_CACHE": str(tmp_path / "cache")}
    env.pop("WORKBENCH_FAIL_RANK", None)
    spools = [tmp_path / "node0", tmp_path / "node1"]
    agents = _agents(source, f"s3://{bucket}/out/", spools, env)
    for agent in agents:
        assert agent.returncode == 0, agent.stderr[-3000:]
    assert s3.output(bucket, "out") == reference
    assert s3.uploads(bucket) == [] and ".workbench-lock.json" not in s3.objects(bucket, "out")
    for spool in spools:  # each node wrote (and emptied) its own spool: its files went straight to the bucket
        assert spool.is_dir() and not [p for p in spool.rglob("*") if p.is_file() and not p.name.startswith(".workbench")]

    agents = _agents(source, f"s3://{bucket}/failing/", spools, {**env, "WORKBENCH_FAIL_RANK": "1"})
    assert all(agent.returncode != 0 for agent in agents)
    assert any("rank 1 failed" in agent.stderr for agent in agents), [a.stderr[-2000:] for a in agents]
    left = s3.objects(bucket, "failing")
    assert INDEX not in left and ".workbench-lock.json" not in left and s3.uploads(bucket) == []
