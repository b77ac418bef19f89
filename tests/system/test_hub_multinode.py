"""Two torchrun "nodes" (two agents on this host, c10d rendezvous on 127.0.0.1), each with its own spool and its
own workbench cache (so its own upload ledger: no folder shared), write one repo of the local Hub fixture; the ranks
send their upload records to rank 0 over the process group and rank 0 makes the one commit. The commit is
byte-identical to the one-process local conversion (issue 35 item 3)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from remote_servers import HubServer, folder_files, hub_writes

import workbench as wb
from tests.conftest import SAMPLES
from tests.system.test_s3_multinode import _agents

pytestmark = [pytest.mark.distributed, pytest.mark.filterwarnings("ignore:Use .content=:DeprecationWarning")]


def test_two_nodes_without_a_shared_folder_commit_once_to_the_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = SAMPLES / "tiny-llama"
    wb.convert(source, tmp_path / "local", shard_size="70KB", dtype="bf16", quiet=True)
    reference = folder_files(tmp_path / "local")
    hub = HubServer(tmp_path / "hub-store", chunk_size=64 << 10)
    try:
        hub_writes(monkeypatch, hub)
        hub.create("org/nodes")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env.pop("WORKBENCH_FAIL_RANK", None)
        spools = [tmp_path / "node0", tmp_path / "node1"]
        caches = {str(spool): str(tmp_path / f"cache-{spool.name}") for spool in spools}  # one ledger per node
        agents = _agents(source, "hf://org/nodes", spools, env, caches)
        for agent in agents:
            assert agent.returncode == 0, agent.stderr[-3000:]
        assert len(hub.commits) == 1
        found = hub.lookup("org/nodes", "main")
        assert found is not None
        published = {p.relative_to(found[1]).as_posix(): p.read_bytes() for p in found[1].rglob("*")
                     if p.is_file() and p.name != ".gitattributes"}
        assert published == reference
        ledgers = [next(Path(c).rglob("ledger.jsonl")) for c in caches.values()]
        assert all('"name"' in ledger.read_text() for ledger in ledgers)  # both nodes uploaded files of their own
        for spool in spools:
            assert not [p for p in spool.rglob("*") if p.is_file() and not p.name.startswith(".workbench")]
    finally:
        hub.stop()
