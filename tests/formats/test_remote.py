"""Remote checkpoints (hf://, http(s)://, s3://) against real local servers: nginx for HTTP ranges, a
Hub endpoint (HF_ENDPOINT) for huggingface_hub, moto's S3 server for s3fs, and servers with faults.

Request and byte counts come from the servers' own logs (nginx's access log, the Hub fixture's log)."""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import struct
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from remote_servers import NGINX, HubServer, Nginx, faulty_servers, isolated_cache
from safetensors.numpy import save_file

import workbench as wb
from tests.conftest import SAMPLES, output_names
from workbench import cli
from workbench.errors import CheckpointError
from workbench.formats import remote_safetensors
from workbench.formats.remote import RemoteError, RemoteFileChanged, is_remote
from workbench.formats.remote_safetensors import FIRST_READ
from workbench.mapper import Identity, Parallel

SHARDS = ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors"]


def _llama(seed: int = 0) -> dict[str, dict[str, np.ndarray]]:
    """Three shards of a 4-layer llama-like model, ~1 MiB each: headers are a small part of every file."""
    rng = np.random.default_rng(seed)
    h = 128
    shards: dict[str, dict[str, np.ndarray]] = {s: {} for s in SHARDS}
    for layer in range(4):
        shard = shards[SHARDS[layer // 2]]
        p = f"model.layers.{layer}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shard[p + f"self_attn.{name}.weight"] = rng.standard_normal((h, h), dtype=np.float32)
        for name, shape in (("gate_proj", (2 * h, h)), ("up_proj", (2 * h, h)), ("down_proj", (h, 2 * h))):
            shard[p + f"mlp.{name}.weight"] = rng.standard_normal(shape, dtype=np.float32)
        shard[p + "input_layernorm.weight"] = np.ones(h, np.float32)
    shards[SHARDS[2]]["model.embed_tokens.weight"] = rng.standard_normal((512, h), dtype=np.float32)
    shards[SHARDS[2]]["model.norm.weight"] = np.ones(h, np.float32)
    shards[SHARDS[2]]["lm_head.weight"] = rng.standard_normal((512, h), dtype=np.float32)
    return shards


def _write_sharded(folder: Path, seed: int = 0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for shard, tensors in _llama(seed).items():
        save_file(tensors, str(folder / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "float32"}))
    return folder


def _exact_header_file(path: Path, header_total: int) -> None:
    """A safetensors file whose header (8-byte length + JSON) is exactly `header_total` bytes, data after it."""
    data = np.arange(100_000, dtype=np.float32).tobytes()
    body = json.dumps({"x": {"dtype": "F32", "shape": [100_000], "data_offsets": [0, len(data)]}}).encode()
    n = header_total - 8
    path.write_bytes(struct.pack("<Q", n) + body.ljust(n, b" ") + data)


@pytest.fixture(scope="session")
def served(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("served")
    _write_sharded(root / "llama")
    _write_sharded(root / "llama-v2", seed=1)
    (root / "single").mkdir()
    shutil.copy(root / "llama" / SHARDS[0], root / "single" / "model.safetensors")
    (root / "edge").mkdir()
    _exact_header_file(root / "edge" / "fits.safetensors", FIRST_READ)
    _exact_header_file(root / "edge" / "over.safetensors", FIRST_READ + 1)
    shutil.copytree(SAMPLES / "training" / "dcp_2ranks", root / "dcp")
    shutil.copytree(SAMPLES / "training" / "dcp_pp", root / "dcp_pp")
    (root / "dcp" / "config.json").write_text(json.dumps({"model_type": "toy"}))
    (root / "flax").mkdir()
    (root / "flax" / "flax_model.msgpack").write_bytes(b"\x80" * 64)
    (root / "torch").mkdir()
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    state = {f"layers.{i}.weight": torch.randn(128, 256, generator=g) for i in range(6)}  # 128 KiB storages
    state["transposed"] = torch.randn(256, 128, generator=g).t()  # a strided view
    state["half"] = torch.randn(64, 64, generator=g).to(torch.bfloat16)
    torch.save(state, root / "torch" / "pytorch_model.bin")
    (root / "torch-sharded").mkdir()
    weight_map = {}
    for k, names in enumerate((["layers.0.weight", "layers.1.weight", "transposed"], ["layers.2.weight", "half"])):
        shard = f"pytorch_model-{k + 1:05d}-of-00002.bin"
        torch.save({n: state[n] for n in names}, root / "torch-sharded" / shard)
        weight_map.update(dict.fromkeys(names, shard))
    (root / "torch-sharded" / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (root / "torch-sharded" / "config.json").write_text(json.dumps({"model_type": "toy"}))
    return root


@pytest.fixture(scope="session")
def nginx(served, tmp_path_factory):
    if NGINX is None:
        pytest.skip("nginx is not installed (make test installs Debian's nginx; apt-get install nginx)")
    server = Nginx(served, tmp_path_factory.mktemp("nginx"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def hub(served):
    server = HubServer()
    server.add("org/llama", served / "llama")
    server.add("org/single", served / "single")
    server.add("org/dcp", served / "dcp")
    server.add("org/dcp-pp", served / "dcp_pp")
    server.add("org/flax", served / "flax")
    server.add("org/torch", served / "torch")
    server.add("org/torch-sharded", served / "torch-sharded")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3(served):
    moto = pytest.importorskip("moto.server")
    env = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    server = moto.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket="ckpts")
    for f in (served / "llama").iterdir():
        client.upload_file(str(f), "ckpts", f"llama/{f.name}")
    for f in (served / "dcp").iterdir():
        client.upload_file(str(f), "ckpts", f"dcp/{f.name}")
    for f in (served / "flax").iterdir():
        client.upload_file(str(f), "ckpts", f"flax/{f.name}")
    yield endpoint
    server.stop()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(autouse=True)
def _env(tmp_path, monkeypatch, request):
    isolated_cache(tmp_path, monkeypatch)
    if "hub" in request.fixturenames:
        monkeypatch.setenv("HF_ENDPOINT", request.getfixturevalue("hub").url)
    if "s3" in request.fixturenames:
        monkeypatch.setenv("AWS_ENDPOINT_URL", request.getfixturevalue("s3"))


def _hub_rows(hub) -> list:
    """The Hub fixture's log without huggingface_hub's own agent-registry lookup (not a file read)."""
    return [r for r in hub.requests() if not r[1].startswith("/api/agent-harnesses")]


def _gets(rows, suffix: str = ".safetensors") -> list:
    return [r for r in rows if r[0] == "GET" and r[1].endswith(suffix)]


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> SimpleNamespace:
    """`workbench ARGS` run in this process (the environment the tests set is the command's): its exit status and
    what it printed. `python -m workbench` itself is tested in test_cli.py."""
    capsys.readouterr()
    status = cli.main(list(args))
    out, err = capsys.readouterr()
    return SimpleNamespace(returncode=status, stdout=out, stderr=err)


def _header_bytes(folder: Path) -> dict[str, int]:
    return {s: 8 + struct.unpack("<Q", (folder / s).read_bytes()[:8])[0] for s in SHARDS}


# --- opening: only headers, few requests ---------------------------------------------------------


def test_inspect_https_reads_only_headers(nginx, served, capsys):
    nginx.reset()
    out = _cli(capsys, "inspect", f"{nginx.url}/llama/", "--format", "json")
    assert out.returncode == 0, out.stderr
    local = _cli(capsys, "inspect", str(served / "llama"), "--format", "json")
    assert json.loads(out.stdout)["tensors"] == json.loads(local.stdout)["tensors"]
    rows = nginx.requests()
    gets = _gets(rows)
    sizes = {s: (served / "llama" / s).stat().st_size for s in SHARDS}
    # One range request per shard, from byte 0, no more than the first read; far less than the files.
    assert sorted(r[1].rsplit("/", 1)[1] for r in gets) == SHARDS
    for r in gets:
        shard = r[1].rsplit("/", 1)[1]
        assert r[2] == 206 and r[4] == f"bytes=0-{min(FIRST_READ, sizes[shard]) - 1}"
    assert sum(r[3] for r in gets) <= 3 * FIRST_READ < sum(sizes.values()) / 3
    # The rest: one HEAD per file (plain HTTP cannot list), the index, and config.json (preset suggestions read it
    # as for a local folder).
    config = (served / "llama/config.json").stat().st_size
    assert [r for r in rows if r not in gets and r[0] == "GET"] == [
        ("GET", "/llama/model.safetensors.index.json", 206, (served / "llama/model.safetensors.index.json").stat().st_size,
         f"bytes=0-{(served / 'llama/model.safetensors.index.json').stat().st_size - 1}"),
        ("GET", "/llama/config.json", 206, config, f"bytes=0-{config - 1}")]
    assert len([r for r in rows if r[0] == "HEAD"]) == 5


def test_inspect_hf_reads_only_headers_and_bare_repo_id(hub, served, capsys):
    hub.reset()
    out = _cli(capsys, "inspect", "hf://org/llama", "--format", "json")
    assert out.returncode == 0, out.stderr
    rows = _hub_rows(hub)
    assert [r[1] for r in rows if r[1].startswith("/api/models")] == ["/api/models/org/llama/revision/main?blobs=true"]
    gets = _gets(rows)
    assert len(gets) == 3 and all(r[4] == f"bytes=0-{FIRST_READ - 1}" for r in gets)
    assert not [r for r in rows if r[0] == "HEAD"]  # sizes come from the listing
    local = json.loads(_cli(capsys, "inspect", str(served / "llama"), "--format", "json").stdout)
    assert json.loads(out.stdout)["tensors"] == local["tensors"]
    assert is_remote("org/llama") and not is_remote(str(served / "llama"))
    assert len(wb.open_checkpoint("org/llama")) == len(local["tensors"])
    with pytest.raises(CheckpointError, match="no such file or folder, and as a Hub repo id: .*HTTP 404"):
        wb.open_checkpoint("org/missing")


def test_inspect_s3_reads_only_headers(s3, served, caplog, capsys):
    caplog.set_level("INFO", logger="werkzeug")  # moto's server logs every request it serves
    ck = wb.open_checkpoint("s3://ckpts/llama/")
    served_requests = [r.getMessage() for r in caplog.records if r.name == "werkzeug" and "GET /ckpts" in r.getMessage()]
    assert len(served_requests) == 5  # one listing, the index, one range per shard
    assert sum('" 206 ' in m for m in served_requests) == 4
    stats = ck.catalog.reader.store.stats.snapshot()
    assert all(stats["per_file"][s] == (1, FIRST_READ) for s in SHARDS)
    out = _cli(capsys, "inspect", "s3://ckpts/llama/", "--format", "json")
    assert out.returncode == 0, out.stderr
    local = json.loads(_cli(capsys, "inspect", str(served / "llama"), "--format", "json").stdout)
    assert json.loads(out.stdout)["tensors"] == local["tensors"]


def test_header_boundary_one_or_two_requests(nginx, served):
    """8 + n == FIRST_READ fits the first read (one request); one byte more takes a second request."""
    nginx.reset()
    fits = wb.open_checkpoint(f"{nginx.url}/edge/fits.safetensors")
    over = wb.open_checkpoint(f"{nginx.url}/edge/over.safetensors")
    gets = _gets(nginx.requests())
    assert [(r[1], r[4]) for r in gets] == [
        ("/edge/fits.safetensors", f"bytes=0-{FIRST_READ - 1}"),
        ("/edge/over.safetensors", f"bytes=0-{FIRST_READ - 1}"),
        ("/edge/over.safetensors", f"bytes={FIRST_READ}-{FIRST_READ}"),
    ]
    expected = np.arange(100_000, dtype=np.float32).tobytes()
    assert fits.catalog.read_bytes("x") == expected and over.catalog.read_bytes("x") == expected


def test_reopen_uses_header_cache_and_works_offline(hub, served, monkeypatch):
    first = wb.open_checkpoint("hf://org/llama")
    hub.reset()
    again = wb.open_checkpoint("hf://org/llama")
    assert [r[1] for r in _hub_rows(hub)] == ["/api/models/org/llama/revision/main?blobs=true"]  # no header read
    commit = again.catalog.reader.store.commit
    hub.reset()
    pinned = wb.open_checkpoint(f"hf://org/llama@{commit}")  # lists once (the cached headers are reused) ...
    assert len(_gets(_hub_rows(hub))) == 0
    hub.reset()
    wb.open_checkpoint(f"hf://org/llama@{commit}")  # ... and a commit is immutable: nothing more to ask
    assert _hub_rows(hub) == []
    hub.reset()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    offline = wb.open_checkpoint("hf://org/llama")
    assert _hub_rows(hub) == []
    assert list(offline.catalog.tensors.values()) == list(first.catalog.tensors.values())
    with pytest.raises(RemoteError, match="offline"):
        offline.catalog.read_bytes("model.norm.weight")
    assert len(pinned) == len(first)


def test_cache_misses_when_the_file_changes(nginx, served, tmp_path):
    folder = served / "mutable"
    shutil.rmtree(folder, ignore_errors=True)
    _write_sharded(folder)
    wb.open_checkpoint(f"{nginx.url}/mutable/")
    _write_sharded(folder, seed=1)  # same layout, new bytes: new ETags (nginx's ETag is mtime and size)
    for shard in SHARDS:
        os.utime(folder / shard, (1, 1))
    nginx.reset()
    ck = wb.open_checkpoint(f"{nginx.url}/mutable/")
    assert len(_gets(nginx.requests())) == 3  # every header fetched again
    local = wb.open_checkpoint(folder)
    assert ck.catalog.read_bytes("lm_head.weight") == local.catalog.read_bytes("lm_head.weight")


def test_cli_plan_convert_verify_diff_take_urls(nginx, served, tmp_path, capsys):
    url = f"{nginx.url}/llama/"
    plan = _cli(capsys, "plan", url, "--dtype", "bf16")
    assert plan.returncode == 0 and "downloads: " in plan.stdout and "range request(s)" in plan.stdout, plan.stderr
    out = _cli(capsys, "convert", url, str(tmp_path / "out"), "--dtype", "bf16")
    assert out.returncode == 0, out.stderr
    assert _cli(capsys, "verify", url).returncode == 0
    assert _cli(capsys, "verify", str(tmp_path / "out")).returncode == 0
    sums = tmp_path / "sums.json"
    assert _cli(capsys, "verify", url, "--sidecar", str(sums)).returncode == 0 and sums.exists()
    assert _cli(capsys, "verify", str(served / "llama"), "--sidecar", str(sums)).returncode == 0  # same tensors, same sums
    diff = _cli(capsys, "diff", url, str(served / "llama"))
    assert diff.returncode == 0 and "same 35 tensors" in diff.stdout


def test_non_lazy_formats_say_so(hub, s3):
    for url in ("hf://org/flax", "s3://ckpts/flax/"):
        with pytest.raises(CheckpointError, match=r"flax_model\.msgpack.*read lazily in safetensors.*DCP.*torch\.save zip.*download"):
            wb.open_checkpoint(url)
    with pytest.raises(RemoteError, match="Check the repo id"):
        wb.open_checkpoint("hf://org/nope")


def test_torch_zip_reads_directory_pickle_and_local_headers_only(nginx, hub, served, tmp_path):
    path = served / "torch" / "pytorch_model.bin"
    nginx.reset()
    ck = wb.open_checkpoint(f"{nginx.url}/torch/")
    rows = _gets(nginx.requests(), ".bin")
    size = path.stat().st_size
    assert ck.format == "torch" and len(rows) <= 3 + 8  # tail, first block (data.pkl), pickle, local headers
    assert sum(r[3] for r in rows) < size / 4
    local = wb.open_checkpoint(path)
    assert {n: (t.dtype, t.shape) for n, t in ck.catalog.tensors.items()} == {
        n: (t.dtype, t.shape) for n, t in local.catalog.tensors.items()}
    for name in local.catalog.tensors:  # contiguous, strided and bf16 tensors read the same bytes
        assert bytes(ck.catalog.read_bytes(name)) == bytes(local.catalog.read_bytes(name)), name
    wb.convert(path, tmp_path / "local", quiet=True)
    wb.convert("hf://org/torch", tmp_path / "remote", quiet=True)
    _same(tmp_path / "local", tmp_path / "remote", extras=False)


def test_index_entries_never_leave_the_repo(hub, served, tmp_path):
    folder = tmp_path / "hostile"
    shutil.copytree(served / "llama", folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["lm_head.weight"] = "../llama-v2/" + SHARDS[2]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    hub.add("org/hostile", folder)
    with pytest.raises(CheckpointError, match="points outside the checkpoint"):
        wb.open_checkpoint("hf://org/hostile")
    assert not [r for r in _hub_rows(hub) if "llama-v2" in r[1]]


def test_explorer_takes_a_url(nginx):
    from workbench.widgets.explorer import Explorer

    panel = Explorer(f"{nginx.url}/llama/")
    assert panel.checkpoint.location == f"{nginx.url}/llama/"
    assert len(panel.checkpoint) == 35


# --- converting while downloading ----------------------------------------------------------------


@pytest.fixture(scope="module")
def local_outputs(served, tmp_path_factory):
    out = tmp_path_factory.mktemp("local-out")
    wb.convert(str(served / "llama"), out / "copy", quiet=True, shard_size="2MB")
    wb.convert(str(served / "llama"), out / "bf16", quiet=True, dtype="bfloat16")
    return out


def _same(a: Path, b: Path, extras: bool = True) -> None:
    names = output_names(a)
    assert names == output_names(b) and ("config.json" in names) == extras
    for name in names:
        assert filecmp.cmp(a / name, b / name, shallow=False), name


@pytest.mark.parametrize("kind", ["https", "hf", "s3"])
def test_remote_conversion_is_byte_identical(kind, request, local_outputs, tmp_path, monkeypatch):
    url = {"https": lambda: request.getfixturevalue("nginx").url + "/llama/", "hf": lambda: "hf://org/llama",
           "s3": lambda: "s3://ckpts/llama"}
    if kind == "hf":
        monkeypatch.setenv("HF_ENDPOINT", request.getfixturevalue("hub").url)
    if kind == "s3":
        monkeypatch.setenv("AWS_ENDPOINT_URL", request.getfixturevalue("s3"))
    source = url[kind]()
    report = wb.convert(source, tmp_path / "copy", quiet=True, shard_size="2MB", verify=True)
    assert report.files_match_plan
    _same(local_outputs / "copy", tmp_path / "copy")
    wb.convert(source, tmp_path / "bf16", quiet=True, dtype="bfloat16")
    _same(local_outputs / "bf16", tmp_path / "bf16")


def test_remote_conversion_on_two_local_workers(hub, local_outputs, tmp_path):
    """Workers open the same URL (headers from the cache) and download their own shards' bytes."""
    report = wb.convert("hf://org/llama", tmp_path / "out", quiet=True, shard_size="2MB", nproc=2, launcher="local")
    assert report.files_match_plan and len(report.ranks) == 2
    _same(local_outputs / "copy", tmp_path / "out")


def test_download_bytes_match_the_plan_and_partial_costs_only_its_bytes(nginx, served, tmp_path, monkeypatch):
    monkeypatch.setattr(remote_safetensors, "CHUNK_BYTES", 256 * 1024)
    url = f"{nginx.url}/llama/"
    plan = wb.plan(url, dest=tmp_path / "all")
    nginx.reset()
    wb.convert(url, tmp_path / "all", quiet=True)
    gets = _gets(nginx.requests())
    assert sum(r[3] for r in gets) == sum(n for n, _ in plan.downloads.values())
    assert len(gets) == sum(k for _, k in plan.downloads.values())
    assert max(r[3] for r in gets) <= 256 * 1024
    # the first two layers only: exactly their bytes, from the first shard
    ck = wb.open_checkpoint(url)
    names = [n for n in ck.catalog.tensors if n.startswith(("model.layers.0.", "model.layers.1."))]
    mapper = Parallel(*[Identity(n) for n in names])
    nginx.reset()
    wb.convert(url, tmp_path / "two", mapper, rest="drop", quiet=True)
    gets = _gets(nginx.requests())
    assert sum(r[3] for r in gets) == sum(ck.catalog.tensors[n].nbytes for n in names)
    assert {r[1] for r in gets} == {f"/llama/{SHARDS[0]}"}
    assert "downloads:" in str(wb.plan(url, mapper, rest="drop", dest=tmp_path / "x"))


def test_prefetch_window_bounds_memory(nginx, tmp_path, monkeypatch, local_outputs):
    from workbench.formats.remote_safetensors import RemoteReader

    monkeypatch.setattr(remote_safetensors, "CHUNK_BYTES", 64 * 1024)
    monkeypatch.setattr(remote_safetensors, "WINDOW_BYTES", 256 * 1024)
    peak = [0]
    fill = RemoteReader._fill

    def watched(self, upto):
        fill(self, upto)
        peak[0] = max(peak[0], self._ahead)

    monkeypatch.setattr(RemoteReader, "_fill", watched)
    wb.convert(f"{nginx.url}/llama/", tmp_path / "out", quiet=True, shard_size="2MB")
    largest = max(t.nbytes for t in wb.open_checkpoint(f"{nginx.url}/llama/").catalog.tensors.values())
    assert 0 < peak[0] <= 256 * 1024 + largest  # the window, plus the one range being waited for
    _same(local_outputs / "copy", tmp_path / "out")


def test_interrupted_remote_conversion_resumes(hub, served, tmp_path, monkeypatch, local_outputs):
    monkeypatch.setenv("WORKBENCH_FAIL_RANK", "0")
    with pytest.raises(wb.errors.WorkbenchError if hasattr(wb, "errors") else Exception, match="failure injected"):
        wb.convert("hf://org/llama", tmp_path / "out", quiet=True, shard_size="2MB")
    monkeypatch.delenv("WORKBENCH_FAIL_RANK")
    done = [p.name for p in (tmp_path / "out").glob("*.safetensors")]
    assert done, "the interrupted run committed nothing to resume from"
    hub.reset()
    plan = wb.plan("hf://org/llama", dest=tmp_path / "out", shard_size="2MB")
    assert plan.kept
    wb.convert("hf://org/llama", tmp_path / "out", quiet=True, shard_size="2MB")
    downloaded = sum(r[3] for r in _gets(_hub_rows(hub)))
    total = sum((served / "llama" / s).stat().st_size for s in SHARDS)
    assert downloaded == sum(n for n, _ in plan.downloads.values()) < total
    _same(local_outputs / "copy", tmp_path / "out")


# --- faults --------------------------------------------------------------------------------------


@pytest.fixture
def faulty(served):
    with faulty_servers(served) as make:
        yield make


def test_dropped_connection_is_retried_and_output_identical(faulty, local_outputs, tmp_path):
    server = faulty("drop", times=2)
    ck = wb.open_checkpoint(f"{server.url}/llama/")
    report = wb.convert(ck, tmp_path / "out", quiet=True, shard_size="2MB")
    assert report.files_match_plan
    _same(local_outputs / "copy", tmp_path / "out")
    assert ck.catalog.reader.store.stats.retries == 2 and server.times == 0


def test_server_lying_about_length_fails_clearly(faulty, tmp_path, monkeypatch):
    monkeypatch.setattr("workbench.formats.remote._BACKOFF", (0.0,))
    server = faulty("short", times=None)
    with pytest.raises(RemoteError, match=r"after 4 attempts.*run again"):
        wb.convert(f"{server.url}/llama/", tmp_path / "out", quiet=True)
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()
    assert not list((tmp_path / "out").glob("*.safetensors")) if (tmp_path / "out").exists() else True


def test_s3_object_replaced_during_conversion_is_refused(s3, served, tmp_path):
    import boto3

    client = boto3.client("s3", endpoint_url=s3)
    for f in (served / "llama").iterdir():
        client.upload_file(str(f), "ckpts", f"moving/{f.name}")
    ck = wb.open_checkpoint("s3://ckpts/moving/")
    client.upload_file(str(served / "llama-v2" / SHARDS[1]), "ckpts", f"moving/{SHARDS[1]}")
    with pytest.raises(RemoteFileChanged, match=SHARDS[1]):
        wb.convert(ck, tmp_path / "out", quiet=True, shard_size="2MB")
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()


def test_server_ignoring_ranges_fails_clearly(faulty, tmp_path):
    server = faulty("ignore_range", times=None, min_bytes=1)
    with pytest.raises(RemoteError, match="ignored the Range request"):
        wb.open_checkpoint(f"{server.url}/llama/")


def test_file_changing_between_requests_is_refused(faulty, tmp_path):
    server = faulty("change", min_bytes=1 << 30)
    ck = wb.open_checkpoint(f"{server.url}/llama/")
    with pytest.raises(RemoteFileChanged, match="changed on the server"):
        wb.convert(ck, tmp_path / "out", quiet=True)
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()


# --- DCP folders ---------------------------------------------------------------------------------


def _dcp_url(kind: str, request, monkeypatch) -> str:
    if kind == "hf":
        monkeypatch.setenv("HF_ENDPOINT", request.getfixturevalue("hub").url)
    if kind == "s3":
        monkeypatch.setenv("AWS_ENDPOINT_URL", request.getfixturevalue("s3"))
    return {"https": lambda: request.getfixturevalue("nginx").url + "/dcp/", "hf": lambda: "hf://org/dcp",
            "s3": lambda: "s3://ckpts/dcp/"}[kind]()


@pytest.mark.parametrize("kind", ["https", "hf", "s3"])
def test_dcp_folder_opens_from_metadata_and_reads_like_local(kind, request, served, tmp_path, monkeypatch):
    from workbench.formats.dcp import dcp_chunks

    url = _dcp_url(kind, request, monkeypatch)
    if kind == "https":
        request.getfixturevalue("nginx").reset()
    ck = wb.open_checkpoint(url)
    local = wb.open_checkpoint(served / "dcp")
    assert ck.format == "dcp" and ck.catalog.metadata["writer_ranks"] == "2"
    assert {n: (t.dtype, t.shape) for n, t in ck.catalog.tensors.items()} == {
        n: (t.dtype, t.shape) for n, t in local.catalog.tensors.items()}
    if kind == "https":  # opening read the index and nothing of the data files
        rows = request.getfixturevalue("nginx").requests()
        assert _gets(rows, ".metadata") and not _gets(rows, ".distcp")
    assert dcp_chunks(ck.catalog).equals(dcp_chunks(local.catalog))
    for name in local.catalog.tensors:  # multi-chunk tensors (Shard(0), Shard(1)) assemble the same bytes
        assert bytes(ck.catalog.read_bytes(name)) == bytes(local.catalog.read_bytes(name)), name
    wb.convert(served / "dcp", tmp_path / "local", quiet=True)
    report = wb.convert(url, tmp_path / "remote", quiet=True, verify=True)
    assert report.files_match_plan
    _same(tmp_path / "local", tmp_path / "remote")


def test_dcp_pipeline_stages_and_reads_cost_what_the_plan_says(nginx, served, tmp_path):
    from workbench.formats.dcp import dcp_chunks
    from workbench.formats.remote_dcp import HEAD_BYTES

    url = f"{nginx.url}/dcp_pp/"  # plain HTTP cannot list: the stages are found by asking for ppN/.metadata
    ck = wb.open_checkpoint(url)
    local = wb.open_checkpoint(served / "dcp_pp")
    assert ck.catalog.metadata["stages"] == local.catalog.metadata["stages"] == "2"
    assert ck.catalog.columns["stage"] == local.catalog.columns["stage"]
    plan = wb.plan(url, None, dest=tmp_path / "out")
    planned = sum(n for n, _ in plan.downloads.values())
    nginx.reset()
    wb.convert(url, tmp_path / "out", quiet=True)
    downloaded = sum(r[3] for r in _gets(nginx.requests(), ".distcp"))
    n_chunks = len(dcp_chunks(local.catalog))
    assert 0 < planned <= downloaded <= planned + 2 * HEAD_BYTES * n_chunks  # tensor bytes + chunk layouts
    wb.convert(served / "dcp_pp", tmp_path / "local", quiet=True)
    _same(tmp_path / "local", tmp_path / "out", extras=False)


def test_dcp_index_paths_never_leave_the_repo(hub, tmp_path):
    import pickle

    from torch.distributed.checkpoint.metadata import Metadata

    folder = tmp_path / "hostile-dcp"
    shutil.copytree(SAMPLES / "training" / "dcp_2ranks", folder)
    meta = pickle.loads((folder / ".metadata").read_bytes())  # our own fixture, made by torch
    for info in meta.storage_data.values():
        info.relative_path = "../dcp_2ranks/" + info.relative_path
        break
    assert isinstance(meta, Metadata)
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    hub.add("org/hostile-dcp", folder)
    with pytest.raises(CheckpointError, match="points outside the checkpoint"):
        wb.open_checkpoint("hf://org/hostile-dcp")


# --- sharded torch.save folders ------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["https", "hf"])
def test_sharded_torch_folder_reads_pickles_and_headers_only(kind, request, served, tmp_path, monkeypatch):
    folder = served / "torch-sharded"
    if kind == "hf":
        monkeypatch.setenv("HF_ENDPOINT", request.getfixturevalue("hub").url)
        url = "hf://org/torch-sharded"
    else:
        nginx = request.getfixturevalue("nginx")
        nginx.reset()
        url = f"{nginx.url}/torch-sharded/"
    ck = wb.open_checkpoint(url)
    local = wb.open_checkpoint(folder)
    assert ck.format == local.format == "torch-sharded"
    if kind == "https":  # the index, then each shard's directory, pickle and local headers: a small part of each
        rows = _gets(nginx.requests(), ".bin")
        assert {r[1].rsplit("/", 1)[-1] for r in rows} == {p.name for p in folder.glob("*.bin")}
        from workbench.formats.remote_torch import BLOCK_BYTES, TAIL_BYTES

        shards = list(folder.glob("*.bin"))  # the tail holds the directory; one block per member's local header
        assert sum(r[3] for r in rows) <= len(shards) * (TAIL_BYTES + 8 * BLOCK_BYTES) < sum(p.stat().st_size for p in shards)
    assert {n: (t.dtype, t.shape, t.file) for n, t in ck.catalog.tensors.items()} == {
        n: (t.dtype, t.shape, t.file) for n, t in local.catalog.tensors.items()}
    for name in local.catalog.tensors:  # contiguous, strided (transposed) and bf16 tensors read the same bytes
        assert bytes(ck.catalog.read_bytes(name)) == bytes(local.catalog.read_bytes(name)), name
    wb.convert(folder, tmp_path / "local", quiet=True)
    wb.convert(url, tmp_path / "remote", quiet=True, verify=True)
    _same(tmp_path / "local", tmp_path / "remote")


def test_sharded_torch_index_never_leaves_the_repo(hub, served, tmp_path):
    folder = tmp_path / "hostile-bin"
    shutil.copytree(served / "torch-sharded", folder)
    index = json.loads((folder / "pytorch_model.bin.index.json").read_text())
    index["weight_map"]["half"] = "../torch/pytorch_model.bin"
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    hub.add("org/hostile-bin", folder)
    with pytest.raises(CheckpointError, match="points outside the checkpoint"):
        wb.open_checkpoint("hf://org/hostile-bin")


# --- the Hugging Face cache: snapshots whose files are links into blobs/ -------------------------


def test_hub_cache_snapshot_opens_and_converts_like_the_folder(hub, served, tmp_path, local_outputs):
    from huggingface_hub import hf_hub_download

    for f in sorted(p.name for p in (served / "llama").iterdir()):
        path = hf_hub_download("org/llama", f, cache_dir=tmp_path / "hf", endpoint=hub.url)
    snapshot = Path(path).parent
    assert snapshot.parent.name == "snapshots" and os.path.islink(snapshot / SHARDS[0])
    ck = wb.open_checkpoint(snapshot)
    assert ck.format == "hf-sharded" and len(ck) == 35 and "config.json" in ck.catalog.extras
    wb.convert(snapshot, tmp_path / "out", quiet=True, shard_size="2MB")
    _same(local_outputs / "copy", tmp_path / "out")
    assert not any(os.path.islink(tmp_path / "out" / n) for n in output_names(tmp_path / "out"))


def test_hub_cache_links_may_lead_into_blobs_only(hub, served, tmp_path):
    from huggingface_hub import hf_hub_download

    for f in sorted(p.name for p in (served / "llama").iterdir()):
        path = hf_hub_download("org/llama", f, cache_dir=tmp_path / "hf", endpoint=hub.url)
    snapshot = Path(path).parent
    secret = tmp_path / "secret.json"
    secret.write_text('{"token": "hf_secret"}')
    (snapshot / "config.json").unlink()
    (snapshot / "config.json").symlink_to(secret)  # a link out of blobs/ is not copied into outputs
    assert "config.json" not in wb.open_checkpoint(snapshot).catalog.extras
    blobs = snapshot.parent.parent / "blobs"
    blobs.rename(tmp_path / "elsewhere")
    blobs.symlink_to(tmp_path / "elsewhere")  # blobs/ itself a link: nothing through it is trusted
    with pytest.raises(CheckpointError, match="a link that leads outside the checkpoint folder"):
        wb.open_checkpoint(snapshot)
