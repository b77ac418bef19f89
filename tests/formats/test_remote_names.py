"""Remote sources named and described right (issue 29 D18): a local typo with a slash is a local error (no
network request), login advice names the current command, and a resume refused because the remote source
changed names the file whose version changed."""

from __future__ import annotations

import shutil

import pytest
from remote_servers import HubServer, isolated_cache

import workbench as wb
from tests.formats.test_remote import SHARDS, _write_sharded
from workbench.errors import WorkbenchError
from workbench.formats.remote import is_remote


@pytest.fixture
def hub(monkeypatch):
    server = HubServer()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def _env(tmp_path, monkeypatch):
    isolated_cache(tmp_path, monkeypatch)


def test_a_local_typo_with_a_slash_is_not_asked_of_the_hub(hub, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ck" / "qwen2").mkdir(parents=True)  # the user's folder of checkpoints: `ck/qwen3` is a typo in it
    assert not is_remote("ck/qwen3") and not is_remote("./ck/qwen3")
    with pytest.raises(WorkbenchError, match=r"ck/qwen3.*(no such|does not exist)") as caught:
        wb.open_checkpoint("ck/qwen3")
    assert "Hub" not in caught.value.message or "hf://" in caught.value.message
    assert hub.requests() == []  # no request named a local path
    assert is_remote("org/repo")  # no local folder `org`: a Hub id, as before


def test_hub_errors_advise_the_current_login_command(hub):
    with pytest.raises(WorkbenchError) as caught:
        wb.open_checkpoint("hf://org/missing")
    assert "hf auth login" in caught.value.message and "huggingface-cli" not in caught.value.message


def test_a_changed_remote_source_on_resume_names_the_file(hub, tmp_path, monkeypatch):
    v1 = _write_sharded(tmp_path / "v1")
    hub.add("org/llama", v1)
    monkeypatch.setenv("WORKBENCH_FAIL_RANK", "0")
    with pytest.raises(WorkbenchError, match="failure injected"):
        wb.convert("hf://org/llama", tmp_path / "out", quiet=True, shard_size="2MB")
    monkeypatch.delenv("WORKBENCH_FAIL_RANK")
    v2 = tmp_path / "v2"
    shutil.copytree(v1, v2)
    shutil.copy(_write_sharded(tmp_path / "other", seed=1) / SHARDS[1], v2 / SHARDS[1])  # one shard re-uploaded
    hub.add("org/llama", v2)  # a new commit on main
    plan = wb.plan("hf://org/llama", dest=tmp_path / "out", shard_size="2MB")
    message = " ".join(p.message for p in plan.errors)
    assert SHARDS[1] in message and "version" in message, message
    assert SHARDS[0] not in message and SHARDS[2] not in message


