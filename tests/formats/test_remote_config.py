"""Remote config files are read like local ones (issue 29 D14): `--preset` and `inspect`'s suggestions take the
server's config.json, fetched once into the catalog's cached folder (checked like every cache entry)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from remote_servers import FaultyServer, HubServer

from tests.formats.test_remote import _cli, _write_sharded

CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 128, "intermediate_size": 256,
          "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 4, "vocab_size": 512,
          "torch_dtype": "float32", "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("served")
    _write_sharded(root / "llama")
    (root / "llama" / "config.json").write_text(json.dumps(CONFIG))
    return root


@pytest.fixture(autouse=True)
def _env(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)


@pytest.fixture(params=["https", "hf"])
def url(request, served, monkeypatch):
    if request.param == "https":
        server = FaultyServer(served, "none", times=0)
        yield f"{server.url}/llama/"
    else:
        server = HubServer()
        server.add("org/llama", served / "llama")
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        yield "hf://org/llama"
    server.stop()


def test_inspect_of_a_url_suggests_presets_from_its_config(url, served, capsys):
    local = _cli(capsys, "inspect", str(served / "llama"))
    remote = _cli(capsys, "inspect", url)
    assert remote.returncode == 0, remote.stderr
    wanted = [line for line in local.stdout.splitlines() if line.startswith("suggested preset:")]
    assert wanted and wanted == [line for line in remote.stdout.splitlines() if line.startswith("suggested preset:")]


def test_preset_reads_the_servers_config(url, served, capsys):
    local = _cli(capsys, "plan", str(served / "llama"), "--preset", "hf_to_meta")
    remote = _cli(capsys, "plan", url, "--preset", "hf_to_meta")
    # The fixture has no post-attention norms, so the preset built from the config stops at binding, locally and
    # remotely alike; without the server's config it would stop earlier ("it needs the model's config.json").
    assert "config.json" not in remote.stderr and "Cannot bind" in local.stderr
    assert (remote.returncode, remote.stderr) == (local.returncode, local.stderr)


def test_an_online_reopen_that_skips_the_config_keeps_it_for_offline(served):
    """An HTTP folder cannot be listed, so what an open looked up is cached for offline reopening. A later online
    open that never asks for config.json must add to those lookups, not replace them."""
    import workbench as wb

    server = FaultyServer(served, "none", times=0)
    url = f"{server.url}/llama/"
    assert wb.open_checkpoint(url).suggest().attrs["model_type"] == "llama"  # looks config.json up
    wb.open_checkpoint(url)  # online again, nothing else asked
    server.stop()
    offline = wb.open_checkpoint(url)
    assert any("could not be reached" in w for w in offline.catalog.warnings)
    assert offline.suggest().attrs["model_type"] == "llama"
