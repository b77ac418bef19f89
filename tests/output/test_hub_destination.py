"""The `hf://` destination driven through its five calls against the local Hub fixture (`HubServer`).

What must hold: files are pre-uploaded as they finish and nothing is visible in the repo until the one
commit; the commit (or PR) holds every file byte for byte; a re-run recognises uploads the Hub holds; token,
repo and permission problems are refused with the fix; the fixture's multipart path is the one taken for
files larger than its chunk size.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from remote_servers import HubServer, hub_writes  # noqa: E402

from workbench.errors import PlanError  # noqa: E402
from workbench.output.remote import open_destination  # noqa: E402
from workbench.output.remote.hub import HubError, parse_hub_url  # noqa: E402

pytestmark = [pytest.mark.serial, pytest.mark.filterwarnings("ignore:Use .content=:DeprecationWarning")]  # huggingface_hub's PUT


@pytest.fixture
def hub(tmp_path, monkeypatch):
    server = HubServer(tmp_path / "store", chunk_size=4096, tokens={"hf_test_write": "write", "hf_test_read": "read"})
    hub_writes(monkeypatch, server)
    monkeypatch.setenv("WORKBENCH_SPOOL_DIR", str(tmp_path / "spool"))
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))
    yield server
    server.stop()


def spool_file(folder: Path, name: str, data: bytes) -> tuple[Path, int, str]:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_bytes(data)
    return path, len(data), hashlib.sha256(data).hexdigest()


def files_at(hub: HubServer, repo: str, rev: str = "main") -> dict[str, bytes]:
    found = hub.lookup(repo, rev)
    assert found is not None, f"{repo}@{rev} does not exist"
    folder = found[1]
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def run(dest, tmp_path: Path, contents: dict[str, bytes], extras: dict[str, bytes] | None = None, *, overwrite=False):
    planned = {n: len(d) for n, d in contents.items()}
    state = dest.state(planned, overwrite=overwrite)
    assert not state.errors, state.errors
    dest.begin(planned, sorted(state.kept))
    for name, data in contents.items():
        if name in state.kept:
            continue
        dest.file_done(name, *spool_file(tmp_path / "spool-files", name, data))
    uploads = [(n, spool_file(tmp_path / "spool-extras", n, d)[0]) for n, d in (extras or {}).items()]
    dest.finish(uploads, planned)
    return state


def test_url_forms():
    assert parse_hub_url("hf://org/repo") == ("org/repo", "main", "")
    assert parse_hub_url("hf://org/repo@dev/sub") == ("org/repo", "dev", "sub")
    assert parse_hub_url("hf://org/repo@refs%2Fpr%2F3") == ("org/repo", "refs/pr/3", "")
    with pytest.raises(PlanError, match="hf://org/repo"):
        parse_hub_url("hf://justaname")
    with pytest.raises(PlanError, match="is a commit"):
        open_destination("hf://org/repo@" + "a" * 40, "fp")


def test_one_commit_holds_everything_and_nothing_shows_before(hub, tmp_path):
    shards = {"model-00001-of-00002.safetensors": os.urandom(10_000), "model-00002-of-00002.safetensors": os.urandom(3000)}
    index = b'{"weight_map": {}}'
    dest = open_destination("hf://org/out", "fp1", {"create": True, "private": True, "commit_message": "converted"})
    planned = {n: len(d) for n, d in shards.items()}
    assert dest.state(planned, overwrite=False).errors == []
    dest.begin(planned, [])
    for name, data in shards.items():
        dest.file_done(name, *spool_file(tmp_path / "spool", name, data))
        assert set(files_at(hub, "org/out")) == {".gitattributes"}  # uploaded, yet in no commit
    assert set(dest.completed()) == set(shards)
    multipart = [r for r in hub.requests() if r[0] == "PUT" and "/part/" in r[1]]
    assert len(multipart) == 3  # 10,000 bytes in 4,096-byte parts; the 3,000-byte file went in one PUT
    dest.finish([("model.safetensors.index.json", spool_file(tmp_path / "x", "index.json", index)[0])], planned)
    assert [c["summary"] for c in hub.commits] == ["converted"]
    assert files_at(hub, "org/out") == {".gitattributes": files_at(hub, "org/out")[".gitattributes"], **shards,
                                        "model.safetensors.index.json": index}
    assert "org/out" in hub.private
    assert dest.read_url == f"hf://org/out@{hub.commits[0]['oid']}"


def test_rerun_keeps_uploaded_files_and_commits_once(hub, tmp_path):
    shards = {f"s{i}.safetensors": os.urandom(5000 + i) for i in range(3)}
    planned = {n: len(d) for n, d in shards.items()}
    first = open_destination("hf://org/resume", "fp", {"create": True})
    first.state(planned, overwrite=False)
    first.begin(planned, [])
    first.file_done("s0.safetensors", *spool_file(tmp_path / "a", "s0.safetensors", shards["s0.safetensors"]))
    # killed here: a new process builds a new destination object
    hub.reset()
    again = open_destination("hf://org/resume", "fp", {"create": True})
    state = run(again, tmp_path, shards)
    assert sorted(state.kept) == ["s0.safetensors"]
    uploaded = [r[1] for r in hub.requests() if r[0] == "PUT"]
    assert not any(hashlib.sha256(shards["s0.safetensors"]).hexdigest() in u for u in uploaded)
    assert len(hub.commits) == 1
    assert {n: d for n, d in files_at(hub, "org/resume").items() if n in shards} == shards
    # the same plan again: complete, nothing to do
    assert open_destination("hf://org/resume", "fp").state(planned, overwrite=False).complete
    # another plan (fingerprint) into the same names is refused without overwrite
    errors = open_destination("hf://org/resume", "other").state(planned, overwrite=False).errors
    assert errors and "already holds" in errors[0] and "overwrite=True" in errors[0]


def test_kept_only_when_the_hub_still_holds_the_object(hub, tmp_path):
    data = os.urandom(2000)
    dest = open_destination("hf://org/gone", "fp", {"create": True})
    dest.state({"a.safetensors": 2000}, overwrite=False)
    dest.begin({"a.safetensors": 2000}, [])
    dest.file_done("a.safetensors", *spool_file(tmp_path, "a.safetensors", data))
    (hub.objects / hashlib.sha256(data).hexdigest()).unlink()  # the Hub dropped the unreferenced object
    assert open_destination("hf://org/gone", "fp", {"create": True}).state({"a.safetensors": 2000}, overwrite=False).kept == {}


def test_create_pr_gives_a_pr_ref_and_leaves_main(hub, tmp_path):
    hub.create("org/base")
    main_before = hub.main["org/base"]
    dest = open_destination("hf://org/base", "fp", {"create_pr": True, "commit_message": "proposal"})
    data = {"model.safetensors": os.urandom(6000)}
    run(dest, tmp_path, data)
    assert hub.main["org/base"] == main_before
    assert dest.pr_revision == "refs/pr/1" and dest.pr_url == f"{hub.url}/org/base/discussions/1"
    assert files_at(hub, "org/base", "refs/pr/1")["model.safetensors"] == data["model.safetensors"]
    assert hub.commits[-1]["ref"] == "refs/pr/1"
    # the same plan again: the pull request it opened holds it, so nothing to do (no second pull request)
    assert open_destination("hf://org/base", "fp", {"create_pr": True}).state(
        {"model.safetensors": 6000}, overwrite=False).complete


def test_branch_is_created_with_create(hub, tmp_path):
    hub.create("org/br")
    data = {"model.safetensors": os.urandom(100)}
    assert "no branch 'dev'" in open_destination("hf://org/br@dev", "fp").state({"model.safetensors": 100}, overwrite=False).errors[0]
    run(open_destination("hf://org/br@dev", "fp", {"create": True}), tmp_path, data)
    assert files_at(hub, "org/br", "dev")["model.safetensors"] == data["model.safetensors"]
    assert set(files_at(hub, "org/br")) == {".gitattributes"}


def test_small_text_files_go_inline(hub, tmp_path):
    hub.create("org/txt")
    data = {"notes.txt": b"plain text\n", "model.safetensors": os.urandom(50)}
    dest = open_destination("hf://org/txt", "fp")
    run(dest, tmp_path, data)
    assert {n: d for n, d in files_at(hub, "org/txt").items() if n in data} == data
    assert hub.commits[0]["files"] and not list((dest.folder / "regular").iterdir())  # its kept copy went with the commit


def test_refusals_name_the_fix(hub, tmp_path, monkeypatch):
    planned = {"model.safetensors": 10}
    errors = open_destination("hf://org/missing", "fp").state(planned, overwrite=False).errors
    assert "does not exist" in errors[0] and "create=True" in errors[0]
    hub.create("org/there")
    monkeypatch.delenv("HF_TOKEN")
    errors = open_destination("hf://org/there", "fp").state(planned, overwrite=False).errors
    assert "no Hugging Face token" in errors[0] and "hf auth login" in errors[0]
    monkeypatch.setenv("HF_TOKEN", "hf_test_read")
    errors = open_destination("hf://org/there", "fp").state(planned, overwrite=False).errors
    assert "HTTP 403" in errors[0] and "write access" in errors[0]
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    errors = open_destination("hf://org/there", "fp").state(planned, overwrite=False).errors
    assert "HTTP 401" in errors[0] and "hf auth login" in errors[0]
    dest = open_destination("hf://org/there", "fp")
    with pytest.raises(HubError, match="HTTP 401"):
        dest.file_done("model.safetensors", *spool_file(tmp_path, "model.safetensors", b"0123456789"))


def test_finish_refuses_a_missing_upload(hub, tmp_path):
    hub.create("org/part")
    dest = open_destination("hf://org/part", "fp")
    dest.begin({"a.safetensors": 5, "b.safetensors": 5}, [])
    dest.file_done("a.safetensors", *spool_file(tmp_path, "a.safetensors", b"12345"))
    with pytest.raises(HubError, match="never uploaded.*b.safetensors"):
        dest.finish([], {"a.safetensors": 5, "b.safetensors": 5})
    assert hub.commits == []


def test_a_commit_landing_meanwhile_is_refused(hub, tmp_path):
    from huggingface_hub import CommitOperationAdd, HfApi

    hub.create("org/race")
    dest = open_destination("hf://org/race", "fp")
    dest.begin({"a.safetensors": 5}, [])
    dest.file_done("a.safetensors", *spool_file(tmp_path, "a.safetensors", b"12345"))
    HfApi(endpoint=hub.url).create_commit("org/race", [CommitOperationAdd("other.txt", b"x")], commit_message="meanwhile")
    with pytest.raises(HubError, match="moved while the conversion ran"):
        dest.finish([], {"a.safetensors": 5})


def test_yes_no_options_from_the_cli(hub):
    assert open_destination("hf://org/x", "fp", {"create": "false", "create_pr": "true"}).create is False
    assert open_destination("hf://org/x", "fp", {"create_pr": "true"}).create_pr is True
    with pytest.raises(PlanError, match="private='maybe' is not yes or no"):
        open_destination("hf://org/x", "fp", {"private": "maybe"})


def test_a_read_only_token_may_open_a_pull_request(hub, tmp_path, monkeypatch):
    hub.create("org/theirs")
    monkeypatch.setenv("HF_TOKEN", "hf_test_read")
    assert "HTTP 403" in open_destination("hf://org/theirs", "fp").state({"model.safetensors": 8}, overwrite=False).errors[0]
    run(open_destination("hf://org/theirs", "fp", {"create_pr": True}), tmp_path, {"model.safetensors": b"12345678"})
    assert [c["ref"] for c in hub.commits] == ["refs/pr/1"]


def test_rank0_adopts_the_other_nodes_records_and_commits_their_files(hub, tmp_path, monkeypatch):
    hub.create("org/nodes")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two nodes of two ranks: no shared folder needed any more
    node0 = open_destination("hf://org/nodes", "fp", {"ledger_dir": str(tmp_path / "node0")})
    node1 = open_destination("hf://org/nodes", "fp", {"ledger_dir": str(tmp_path / "node1")})
    files = {"model-1.safetensors": b"1" * 64, "model-2.safetensors": b"2" * 64, "notes.txt": b"inline"}
    assert node0.state({n: len(b) for n, b in files.items()}, overwrite=False).errors == []
    node0.begin({n: len(b) for n, b in files.items()}, [])
    for node, name in ((node0, "model-1.safetensors"), (node1, "model-2.safetensors"), (node1, "notes.txt")):
        path = tmp_path / name
        path.write_bytes(files[name])
        node.file_done(name, path, len(files[name]), hashlib.sha256(files[name]).hexdigest())
    sent = json.loads(json.dumps(node1.records()))  # as all_gather_object carries them: plain JSON values
    sent.append({**sent[0], "fingerprint": "another plan", "name": "other.safetensors"})
    node0.adopt(sent)
    node0.adopt(sent)  # twice: nothing recorded twice
    assert sorted(node0.completed()) == sorted(files)
    node0.finish([], {n: len(b) for n, b in files.items()})
    shown = files_at(hub, "org/nodes")
    assert {n: b for n, b in shown.items() if n != ".gitattributes"} == files and len(hub.commits) == 1

