"""Remote quantised checkpoints get the same `quant_*` catalog columns as local ones (issue 33): the server's
config.json (hf://, https://, s3://) is fetched into the catalog's cached folder and read as a local one would be;
a checkpoint with no packed tensor names is not asked for it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from remote_servers import FaultyServer, HubServer

import workbench as wb
from tests.mapper.test_gptq import make_gptq

COLUMNS = ["quant_format", "quant_role", "quant_bits", "quant_group", "quant_sym", "quant_parts"]


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("served")
    make_gptq(root / "gptq", bits=4, sym=False, desc_act=True)
    make_gptq(root / "awq", method="awq", bits=4, sym=False)
    return root


@pytest.fixture(autouse=True)
def _env(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)


@pytest.fixture(params=["https", "hf", "s3"])
def url_of(request, served, monkeypatch):
    """name -> the URL of `served / name` on a local server of the kind `request.param`."""
    if request.param == "https":
        server = FaultyServer(served, "none", times=0)
        yield lambda name: f"{server.url}/{name}/"
    elif request.param == "hf":
        server = HubServer()
        for name in ("gptq", "awq"):
            server.add(f"org/{name}", served / name)
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        yield lambda name: f"hf://org/{name}"
    else:
        pytest.importorskip("moto.server")
        from remote_servers import MotoS3

        server = MotoS3()
        for key, value in {**server.env, "AWS_MAX_ATTEMPTS": "1"}.items():
            monkeypatch.setenv(key, value)
        bucket = server.bucket("quant")
        urls = {name: server.upload_folder(served / name, bucket, name) for name in ("gptq", "awq")}
        yield urls.__getitem__
    server.stop()


def _columns(ck) -> list[tuple]:
    table = ck.tensors
    assert set(COLUMNS) <= set(table.columns), list(table.columns)
    rows = table[table["quant_format"].notna()][COLUMNS]
    return sorted((name, *(tuple(v) if isinstance(v, (list, tuple)) else v for v in row))
                  for name, row in zip(rows.index, rows.itertuples(index=False), strict=True))


@pytest.mark.parametrize("name", ["gptq", "awq"])
def test_a_remote_checkpoint_has_the_quant_columns_of_its_local_copy(url_of, served, name):
    local = _columns(wb.open_checkpoint(served / name))
    remote = _columns(wb.open_checkpoint(url_of(name)))
    assert remote == local and len(local) == 2 * 7 * (4 if name == "gptq" else 3)
    packed = {row[0]: row for row in remote}["model.layers.0.mlp.down_proj.qweight"]
    assert packed[1:6] == (name, "packed", 4, "32", False)


def test_inspect_of_a_url_shows_the_columns(url_of, served, capsys):
    from workbench.cli import main

    assert main(["inspect", url_of("awq"), "--format", "json"]) == 0
    records = {r["name"]: r for r in json.loads(capsys.readouterr().out)["tensors"]}
    row = records["model.layers.1.self_attn.q_proj.qweight"]
    assert (row["quant_format"], row["quant_role"], row["quant_bits"]) == ("awq", "packed", 4)
    assert row["quant_parts"] == ["model.layers.1.self_attn.q_proj.scales", "model.layers.1.self_attn.q_proj.qzeros"]


def test_a_plain_remote_checkpoint_is_not_asked_for_its_config(tmp_path, monkeypatch):
    import torch
    from safetensors.torch import save_file

    folder = tmp_path / "plain"
    folder.mkdir()
    save_file({"model.norm.weight": torch.ones(8)}, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    hub = HubServer()
    try:
        hub.add("org/plain", folder)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        ck = wb.open_checkpoint("hf://org/plain")
        assert "quant_format" not in ck.tensors.columns
        assert not [r for r in hub.requests() if "config.json" in r[1]]
    finally:
        hub.stop()
