"""Conversions into `hf://org/repo` through the local Hub fixture, end to end (wb.convert, workers, the CLI).

Each output must equal the local conversion byte for byte, be invisible until one commit publishes it, survive
a kill at random moments (the re-run commits once, identical), keep the spool within its bound, and read back
(`wb.open_checkpoint`, `verify=True`) from the uploaded objects, never the spool.
"""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path

import pytest
from remote_servers import HubServer, hub_writes

import workbench as wb
from tests.conftest import SAMPLES, output_names

pytestmark = [pytest.mark.serial, pytest.mark.filterwarnings("ignore:Use .content=:DeprecationWarning")]  # huggingface_hub's PUT
REPO = Path(__file__).resolve().parents[2]
SHARD = "150KB"  # the 720 KB tiny Llama in 5 shards, bf16: 3 shards


@pytest.fixture
def hub(tmp_path, monkeypatch):
    server = HubServer(tmp_path / "hub-store", chunk_size=64 << 10)
    hub_writes(monkeypatch, server)
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("WORKBENCH_SPOOL_DIR", str(tmp_path / "spool"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def local_out(tmp_path_factory):
    out = tmp_path_factory.mktemp("local") / "out"
    wb.convert(SAMPLES / "tiny-llama", out, None, shard_size=SHARD, dtype="bf16", quiet=True)
    return out


def committed(hub: HubServer, repo: str, rev: str = "main") -> dict[str, bytes]:
    found = hub.lookup(repo, rev)
    assert found is not None, f"{repo}@{rev} does not exist"
    return {p.relative_to(found[1]).as_posix(): p.read_bytes() for p in found[1].rglob("*")
            if p.is_file() and p.name != ".gitattributes"}


def local_files(folder: Path) -> dict[str, bytes]:
    return {n: (folder / n).read_bytes() for n in output_names(folder) if not n.startswith(".")}


def spooled(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "spool").rglob("*") if p.is_file())


def test_local_source_to_hub_is_the_local_conversion(hub, tmp_path, local_out, monkeypatch):
    from workbench.output.remote.hub import HubDestination

    seen = []
    original = HubDestination.file_done

    def watched(self, name, path, size, sha256):
        seen.append((name, sorted(committed(hub, "org/out")) if "org/out" in hub.main else None))
        return original(self, name, path, size, sha256)

    monkeypatch.setattr(HubDestination, "file_done", watched)
    report = wb.convert(SAMPLES / "tiny-llama", "hf://org/out", None, shard_size=SHARD, dtype="bf16", quiet=True,
                        remote_options={"create": True, "private": True, "commit_message": "bf16 shards"})
    assert committed(hub, "org/out") == local_files(local_out)
    assert [c["summary"] for c in hub.commits] == ["bf16 shards"]
    assert len(seen) == 3 and all(files == [] for _, files in seen)  # each upload happened with nothing committed
    assert "org/out" in hub.private
    assert spooled(tmp_path) == []  # every spool copy deleted
    assert report.spool_peak > 0


def test_hub_source_to_hub_and_read_back_from_the_commit(hub, tmp_path, local_out):
    hub.add("org/src", SAMPLES / "tiny-llama")
    report = wb.convert("hf://org/src", "hf://org/dst", None, shard_size=SHARD, dtype="bf16", quiet=True,
                        remote_options={"create": True}, verify=True)
    assert committed(hub, "org/dst") == local_files(local_out)
    assert report.output_check is not None and report.output_check.ok
    assert report.output_check.statement.startswith("the transformers LlamaForCausalLM (llama) statement")  # config.json re-read
    commit = hub.commits[-1]["oid"]
    assert report.url == f"hf://org/dst@{commit}" and report.pr_url is None
    assert report.summary().startswith(f"Converted into hf://org/dst@{commit} in ")
    reads = [r for r in hub.requests() if r[0] == "GET" and f"/org/dst/resolve/{commit}/" in r[1]]
    assert reads, "verify did not read the uploaded objects"
    assert spooled(tmp_path) == []  # nothing left locally that verify could have read instead
    back = wb.open_checkpoint(f"hf://org/dst@{commit}")
    ours = wb.open_checkpoint(local_out)
    assert list(back.tensors.index) == list(ours.tensors.index)
    name = back.tensors.index[3]
    assert back.load(name).equal(ours.load(name))


@pytest.mark.parametrize("kind", ["https", "s3"])
def test_https_and_s3_sources_to_hub_are_the_local_conversion(hub, tmp_path, local_out, monkeypatch, kind):
    """An nginx-served folder (read by range) and a moto S3 prefix, each converted into a repo: the local bytes."""
    import shutil

    from remote_servers import NGINX, MotoS3, Nginx

    served = tmp_path / "served" / "src"
    shutil.copytree(SAMPLES / "tiny-llama", served)
    if kind == "https":
        if NGINX is None:
            pytest.skip("nginx is not installed (make test installs Debian's nginx; apt-get install nginx)")
        server = Nginx(served.parent, tmp_path / "nginx")
        url = f"{server.url}/src/"
    else:
        pytest.importorskip("moto.server")
        server = MotoS3()
        for key, value in server.env.items():
            monkeypatch.setenv(key, value)
        bucket = server.bucket()
        url = server.upload_folder(served, bucket, "src")
    try:
        report = wb.convert(url, f"hf://org/{kind}", None, shard_size=SHARD, dtype="bf16", quiet=True,
                            remote_options={"create": True})
        assert committed(hub, f"org/{kind}") == local_files(local_out) and len(hub.commits) == 1
        assert report.files_match_plan and spooled(tmp_path) == []
        if kind == "https":
            assert any(r[1].endswith(".safetensors") and r[4] for r in server.requests())  # read from nginx, by range
    finally:
        server.stop()


def test_create_pr_and_read_the_pr(hub, local_out):
    hub.create("org/model")
    main = hub.main["org/model"]
    report = wb.convert(SAMPLES / "tiny-llama", "hf://org/model", None, shard_size=SHARD, dtype="bf16", quiet=True,
                        remote_options={"create_pr": True, "commit_message": "bf16 weights", "commit_description": "from tests"})
    assert hub.main["org/model"] == main
    assert report.pr_url == f"{hub.url}/org/model/discussions/1"
    assert report.summary().splitlines()[0].endswith(f"; pull request to review: {hub.url}/org/model/discussions/1")
    assert [(c["ref"], c["description"]) for c in hub.commits] == [("refs/pr/1", "from tests")]
    assert committed(hub, "org/model", "refs/pr/1") == local_files(local_out)
    pr = wb.open_checkpoint("hf://org/model@refs%2Fpr%2F1")
    assert len(pr.tensors) == len(wb.open_checkpoint(local_out).tensors)


def test_spool_bound_held_on_an_output_four_times_larger(hub, tmp_path):
    source = SAMPLES / "tiny-llama"  # 727 KB; spool 150 KB, shards of 50 KB
    plan = wb.plan(source, None, dest="hf://org/big", shard_size="50KB", spool_size="150KB",
                   remote_options={"create": True})
    total = sum(f.size for f in plan.output_file_list)
    assert total >= 4 * plan.options.spool_size
    assert plan.spool_bytes <= plan.options.spool_size + max(f.size for f in plan.output_file_list)
    report = wb.convert(source, "hf://org/big", None, shard_size="50KB", spool_size="150KB", quiet=True,
                        remote_options={"create": True})
    assert report.spool_peak <= plan.spool_bytes
    local = tmp_path / "local"
    wb.convert(source, local, None, shard_size="50KB", quiet=True)
    assert committed(hub, "org/big") == local_files(local)


def test_clear_refusals(hub, monkeypatch):
    plan = wb.plan(SAMPLES / "tiny-llama", None, dest="hf://org/absent", shard_size=SHARD)
    assert any("does not exist" in p.message and "create=True" in p.message for p in plan.problems)
    monkeypatch.delenv("HF_TOKEN")
    plan = wb.plan(SAMPLES / "tiny-llama", None, dest="hf://org/absent", shard_size=SHARD, remote_options={"create": True})
    assert any("no Hugging Face token" in p.message for p in plan.problems)
    with pytest.raises(wb.errors.PlanError, match="no Hugging Face token"):
        wb.convert(SAMPLES / "tiny-llama", "hf://org/absent", None, quiet=True, remote_options={"create": True})
    assert hub.commits == [] and "org/absent" not in hub.main
    hub.create("org/guarded")
    hub.tokens = {"hf_ro": "read", "hf_rw": "write"}
    for token, status in (("hf_ro", "HTTP 403"), ("hf_unknown", "HTTP 401")):
        monkeypatch.setenv("HF_TOKEN", token)
        with pytest.raises(wb.errors.PlanError, match=status):
            wb.convert(SAMPLES / "tiny-llama", "hf://org/guarded", None, quiet=True)
    assert hub.commits == []


KILLS = 20


def _killed(source: Path, url: str, kill_at: int) -> tuple[int, int]:
    """Run the conversion in a forked child (this process's imports: no start-up cost) that SIGKILLs itself at its
    `kill_at`-th event (a Hub request, a spool write, a ledger line, a rename: as a kill from outside at that moment
    would, without cleanup); (the child's wait status, the events it counted, 0 when killed)."""
    import threading

    import huggingface_hub

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code, real_write = 1, os.write
        try:
            os.close(read)
            events, counting = [0], threading.Lock()

            def counted(fn):
                def call(*args, **kwargs):
                    with counting:
                        events[0] += 1
                        if events[0] == kill_at:
                            os.kill(os.getpid(), signal.SIGKILL)
                    return fn(*args, **kwargs)
                return call

            for name in ("model_info", "create_repo", "preupload_lfs_files", "create_commit"):
                setattr(huggingface_hub.HfApi, name, counted(getattr(huggingface_hub.HfApi, name)))
            for name in ("pwrite", "write", "fsync", "replace", "unlink"):
                setattr(os, name, counted(getattr(os, name)))
            wb.convert(source, url, None, shard_size="50KB", dtype="bf16", quiet=True, remote_options={"create": True})
            real_write(write, str(events[0]).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    import select

    if not select.select([read], [], [], 120)[0]:  # a child stuck (e.g. on a lock held at the fork) fails, not hangs
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(read)
        raise AssertionError(f"the child killed at event {kill_at} neither finished nor died within 120 s")
    with os.fdopen(read) as answer:
        counted_events = int(answer.read() or 0)
    return os.waitpid(pid, 0)[1], counted_events


def test_killed_runs_are_invisible_or_complete_and_the_rerun_commits_the_same(hub, tmp_path):
    """SIGKILL at 20 seeded random moments (Hub requests, spool writes, ledger lines, renames), each into its own
    repo, then the same conversion again in this process: before the re-run the repo shows nothing or exactly the
    local conversion; after it, exactly the local conversion, with nothing left in the spool."""
    source = SAMPLES / "tiny-llama"
    local = tmp_path / "local"
    wb.convert(source, local, None, shard_size="50KB", dtype="bf16", quiet=True)
    expected = local_files(local)
    status, total = _killed(source, "hf://org/clean", 0)
    assert status == 0 and committed(hub, "org/clean") == expected and total > KILLS
    moments = sorted(random.Random(35).sample(range(1, total + 1), KILLS))
    outcomes, uploads_again = [], 0
    for k, kill_at in enumerate(moments):
        repo = f"org/killed{k}"
        before = len(hub.commits)
        status, _ = _killed(source, f"hf://{repo}", kill_at)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (kill_at, status)
        shown = committed(hub, repo) if repo in hub.main else {}
        assert shown in ({}, expected), f"kill at event {kill_at}: the repo shows part of an output"
        outcomes.append("complete" if shown else "invisible")
        assert len(hub.commits) - before == (1 if shown else 0)
        puts = len([r for r in hub.requests() if r[0] == "PUT"])
        wb.convert(source, f"hf://{repo}", None, shard_size="50KB", dtype="bf16", quiet=True, remote_options={"create": True})
        uploads_again += len([r for r in hub.requests() if r[0] == "PUT"]) - puts
        assert committed(hub, repo) == expected, f"kill at event {kill_at}: the re-run differs"
        assert len(hub.commits) - before <= 2  # the killed run's commit (if it landed) and at most one more
        assert spooled(tmp_path) == [], f"kill at event {kill_at}: spool files left"
    assert outcomes.count("invisible") >= KILLS // 2, outcomes
    assert uploads_again < KILLS * len([n for n in expected if n.endswith(".safetensors")])  # finished uploads were kept
    print("Hub kill outcomes:", outcomes)


def test_cli_convert_to_a_pr_and_verify(hub, local_out, capsys):
    from workbench.cli import commands as cli

    hub.create("org/cli")
    code = cli.main(["convert", str(SAMPLES / "tiny-llama"), "hf://org/cli", "--shard-size", SHARD, "--dtype", "bf16",
                     "--quiet", "--verify", "--remote-option", "create_pr=true", "--remote-option", "commit_message=from the cli"])
    assert code == 0, capsys.readouterr()
    assert [(c["ref"], c["summary"]) for c in hub.commits] == [("refs/pr/1", "from the cli")]
    assert committed(hub, "org/cli", "refs/pr/1") == local_files(local_out)
    assert cli.main(["convert", str(SAMPLES / "tiny-llama"), "hf://org/nowhere", "--quiet"]) != 0
    assert "does not exist" in capsys.readouterr().err


def test_overwrite_replaces_an_older_output_in_one_commit(hub, local_out, tmp_path):
    old = tmp_path / "old"
    wb.convert(SAMPLES / "tiny-llama", old, None, shard_size="100KB", quiet=True)  # F32 in 8 shards; ours: bf16 in 3
    assert not set(local_files(old)) >= set(local_files(local_out))
    hub.add("org/old", old)
    plan = wb.plan(SAMPLES / "tiny-llama", None, dest="hf://org/old", shard_size=SHARD, dtype="bf16")
    assert any("already holds" in p.message and "overwrite=True" in p.message for p in plan.problems)
    wb.convert(SAMPLES / "tiny-llama", "hf://org/old", None, shard_size=SHARD, dtype="bf16", quiet=True, overwrite=True)
    assert len(hub.commits) == 1
    assert committed(hub, "org/old") == local_files(local_out)  # the old shards are gone, not left beside the new


def test_two_ranks_upload_their_own_files_and_rank0_commits_once(hub, local_out):
    report = wb.convert(SAMPLES / "tiny-llama", "hf://org/ranks", None, shard_size=SHARD, dtype="bf16", nproc=2,
                        quiet=True, remote_options={"create": True})
    assert len(hub.commits) == 1
    assert committed(hub, "org/ranks") == local_files(local_out)
    assert all(r.files_written for r in report.ranks) and len(report.ranks) == 2  # both ranks wrote and uploaded


def test_a_killed_worker_rank_leaves_nothing_visible_and_the_rerun_commits_once(hub, local_out, monkeypatch):
    monkeypatch.setenv("WORKBENCH_KILL_RANK", "1")  # rank 1 is SIGKILLed before committing its last file
    with pytest.raises(wb.errors.PlanError):
        wb.convert(SAMPLES / "tiny-llama", "hf://org/worker", None, shard_size=SHARD, dtype="bf16", nproc=2, quiet=True,
                   remote_options={"create": True})
    assert hub.commits == [] and committed(hub, "org/worker") == {}
    monkeypatch.delenv("WORKBENCH_KILL_RANK")
    wb.convert(SAMPLES / "tiny-llama", "hf://org/worker", None, shard_size=SHARD, dtype="bf16", nproc=2, quiet=True,
               remote_options={"create": True})
    assert len(hub.commits) == 1
    assert committed(hub, "org/worker") == local_files(local_out)
