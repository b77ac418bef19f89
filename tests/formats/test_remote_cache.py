"""The remote header cache is checked, not trusted (issue 29 A4), and reopening works offline (A5).

An entry whose bytes were changed after it was written (two tensor names of the same length swapped in a
cached header) is a miss with a `RemoteCacheWarning`; one rewritten whole, digest included, can still fool
an open, but `verify=True` reopens the source without the cache and reports the output as not matching.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from remote_servers import FaultyServer, isolated_cache

import workbench as wb
from tests.formats.test_remote import SHARDS, _write_sharded

Q, K = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("served")
    _write_sharded(root / "llama")
    return root


@pytest.fixture
def server(served):
    s = FaultyServer(served, "none", times=0)  # an honest server with ETags and ranges
    yield s
    s.stop()


@pytest.fixture(autouse=True)
def _env(tmp_path, monkeypatch):
    isolated_cache(tmp_path, monkeypatch)


def _swap_in_cache(cache: Path, *, rewrite_digest: bool) -> Path:
    """Swap Q and K in the cached header that holds them; with `rewrite_digest`, restate the entry's digest too."""
    hits = [p for p in (cache / "remote").rglob("*") if p.is_file() and Q.encode() in p.read_bytes() and b"data_offsets" in p.read_bytes()]
    assert len(hits) == 1, hits
    raw = hits[0].read_bytes()
    swapped = raw.replace(Q.encode(), b"\xff\xfe").replace(K.encode(), Q.encode()).replace(b"\xff\xfe", K.encode())
    line, sep, data = swapped.partition(b"\n")
    if rewrite_digest and sep and line.startswith(b"{") and b"sha256" in line:
        head = json.loads(line)
        head["sha256"] = hashlib.sha256(data).hexdigest()
        swapped = json.dumps(head, sort_keys=True).encode() + b"\n" + data
    hits[0].write_bytes(swapped)
    return hits[0]


def test_an_edited_cache_entry_is_a_miss_with_a_warning(server, served, tmp_path):
    url = f"{server.url}/llama/"
    wb.open_checkpoint(url)
    _swap_in_cache(tmp_path / "cache", rewrite_digest=False)
    with pytest.warns(UserWarning, match="does not match its stated key, size or digest"):
        ck = wb.open_checkpoint(url)
    local = wb.open_checkpoint(served / "llama")
    for name in (Q, K):
        assert np.array_equal(ck.load(name).numpy(), local.load(name).numpy())
    # the entry was fetched again and rewritten: the next open is silent and right
    import warnings

    from workbench.formats.remote_cache import RemoteCacheWarning

    with warnings.catch_warnings():  # only the cache's own warning: an unrelated one (an import's) is not this test's
        warnings.simplefilter("error", RemoteCacheWarning)
        again = wb.open_checkpoint(url)
    assert np.array_equal(again.load(Q).numpy(), local.load(Q).numpy())


def test_verify_rereads_headers_from_the_source_not_the_cache(server, tmp_path):
    url = f"{server.url}/llama/"
    wb.open_checkpoint(url)
    _swap_in_cache(tmp_path / "cache", rewrite_digest=True)
    report = wb.convert(url, tmp_path / "out", quiet=True, verify=True)
    check = report.output_check
    assert not check.ok
    assert {Q, K} <= set(check.mismatches)


def test_an_honest_remote_conversion_still_verifies(server, tmp_path):
    report = wb.convert(f"{server.url}/llama/", tmp_path / "out", quiet=True, verify=True)
    assert report.output_check.ok, report.output_check.summary()
    assert SHARDS[0]  # the fixture's shard names, imported for the cache lookup above


def test_a_source_gone_at_verify_time_leaves_the_output_unverified_not_failed(server, tmp_path, monkeypatch):
    """The server going away after the run cannot make `verify=True` raise over a committed output, nor say
    "all match": every output is "unchecked" and the open output reader is closed."""
    from workbench.formats import remote_safetensors
    from workbench.formats.remote import RemoteError

    def unreachable(url):
        raise RemoteError(f"Cannot reach {url}: connection refused. Check the server.")

    monkeypatch.setattr(remote_safetensors, "reopen_uncached", unreachable)
    report = wb.convert(f"{server.url}/llama/", tmp_path / "out", quiet=True, verify=True)
    check = report.output_check
    assert not check.ok and {row[2] for row in check.rows} == {"unchecked"}
    assert "connection refused" in check.rows[0][5]
    assert (tmp_path / "out" / "model.safetensors.index.json").exists() or (tmp_path / "out" / "model.safetensors").exists()


# --- A5: reopening with the server really stopped -------------------------------------------------


def _same_tables(a, b) -> None:
    assert list(a.catalog.tensors.values()) == list(b.catalog.tensors.values())


def test_http_reopens_from_the_cache_with_the_server_stopped(served, monkeypatch):
    server = FaultyServer(served, "none", times=0)
    url = f"{server.url}/llama/"
    first = wb.open_checkpoint(url)
    assert first.suggest().attrs.get("model_type") == "llama"  # reads config.json from the server
    server.stop()
    for offline in ("0", "1"):
        monkeypatch.setenv("HF_HUB_OFFLINE", offline)
        again = wb.open_checkpoint(url)
        _same_tables(first, again)
        assert any("could not be reached" in w for w in again.catalog.warnings)
        assert again.suggest().attrs.get("model_type") == "llama"  # config.json from the cache
        with pytest.raises(wb.WorkbenchError, match="could not be reached"):
            again.load(Q)


def test_hub_reopens_from_the_cache_with_the_server_stopped(served, monkeypatch):
    from remote_servers import HubServer

    hub = HubServer()
    hub.add("org/llama", served / "llama")
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    first = wb.open_checkpoint("hf://org/llama")
    hub.stop()
    again = wb.open_checkpoint("hf://org/llama")
    _same_tables(first, again)
    assert any("could not be reached" in w for w in again.catalog.warnings)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _same_tables(first, wb.open_checkpoint("hf://org/llama"))


def test_s3_reopens_from_the_cache_with_the_server_stopped(served, monkeypatch):
    moto = pytest.importorskip("moto.server")
    for k, v in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
                 "AWS_MAX_ATTEMPTS": "1"}.items():
        monkeypatch.setenv(k, v)
    server = moto.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{host}:{port}")
    import boto3

    client = boto3.client("s3", endpoint_url=f"http://{host}:{port}")
    client.create_bucket(Bucket="ckpts")
    for f in (served / "llama").iterdir():
        client.upload_file(str(f), "ckpts", f"llama/{f.name}")
    first = wb.open_checkpoint("s3://ckpts/llama/")
    server.stop()
    again = wb.open_checkpoint("s3://ckpts/llama/")
    _same_tables(first, again)
    assert any("could not be reached" in w for w in again.catalog.warnings)
