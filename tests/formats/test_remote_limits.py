"""Lying servers (issue 29, A1-A3, D13, E3): every remote read keeps a byte budget, a checked range and a pace.

`tests/remote_servers.FaultyServer`'s lying modes (`LYING`: a body that never ends, a gzip bomb, HEAD and GET
disagreeing about the size, a range shifted by 4 bytes, a drip of one byte per interval) are run against the
remote readers in this process, and against `python -m workbench inspect/convert URL` in a child process
under a 1 GiB address-space cap: each ends with a clear error, exit 2, no traceback, and a small RSS. The
pace window is made small through the documented environment variables so the file stays fast.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from remote_servers import LYING, FaultyServer, faulty_servers

import workbench as wb
from tests.formats.test_remote import SHARDS, _write_sharded
from workbench.formats import remote_limits
from workbench.formats.remote import RemoteError
from workbench.formats.remote_safetensors import FIRST_READ

REPO = Path(__file__).resolve().parents[2]
# Small enough to keep the file fast, large enough that an honest request on a loaded 2-core machine never stalls.
FAST = {"WORKBENCH_REMOTE_STALL_SECONDS": "2", "WORKBENCH_REMOTE_NOTICE_SECONDS": "0.3",
        "WORKBENCH_REMOTE_DEADLINE_SECONDS": "5"}
# What each mode's error says (besides the URL).
SAYS = {
    "endless": r"more than the \d+ bytes asked for",
    "gzip_bomb": r"Content-Encoding 'gzip'",
    "size_mismatch": r"announced 3221225472 bytes for the 1000 asked for",
    "shift": r"answered bytes \d+-\d+/\d+ to a request for bytes",
    "drip": r"fewer than \d+ bytes arrived in 2 s|the request's 5 s deadline passed",
}
RSS_LIMIT = 150 << 20


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("served")
    _write_sharded(root / "llama")
    torch = pytest.importorskip("torch")
    (root / "torch").mkdir()
    g = torch.Generator().manual_seed(0)
    torch.save({f"layers.{i}.weight": torch.randn(256, 256, generator=g) for i in range(4)}, root / "torch" / "pytorch_model.bin")
    (root / "big").mkdir()
    header = json.dumps({"x": {"dtype": "U8", "shape": [300 << 20], "data_offsets": [0, 300 << 20]}}).encode()
    with open(root / "big" / "model.safetensors", "wb") as fh:  # 300 MB, sparse on disk
        fh.write(struct.pack("<Q", len(header)) + header)
        fh.truncate(8 + len(header) + (300 << 20))
    return root


@pytest.fixture(autouse=True)
def _env(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))
    for k, v in FAST.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr("workbench.formats.remote._BACKOFF", (0.0,))


@pytest.fixture
def faulty(served):
    with faulty_servers(served, drip_seconds=0.5) as make:
        yield make


@pytest.mark.parametrize("folder", ["llama", "torch"])  # the safetensors and torch.save zip readers
@pytest.mark.parametrize("mode", LYING)
def test_lying_server_on_open_is_refused(faulty, mode, folder):
    server = faulty(mode, times=None, min_bytes=0)
    with pytest.raises(RemoteError, match=SAYS[mode]) as caught:
        wb.open_checkpoint(f"{server.url}/{folder}/")
    assert server.url in caught.value.message


@pytest.mark.parametrize("mode", [m for m in LYING if m != "size_mismatch"])
def test_lying_server_on_tensor_reads_is_refused(faulty, mode, tmp_path):
    server = faulty(mode, times=None, min_bytes=FIRST_READ + 1)  # headers are honest, tensor ranges lie
    ck = wb.open_checkpoint(f"{server.url}/llama/")
    with pytest.raises(RemoteError, match=SAYS[mode]) as caught:
        wb.convert(ck, tmp_path / "out", quiet=True)
    assert any(shard in caught.value.message for shard in SHARDS)
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()


def test_a_drip_gives_up_within_the_deadline(faulty, monkeypatch):
    monkeypatch.setenv("WORKBENCH_REMOTE_STALL_SECONDS", "30")
    monkeypatch.setenv("WORKBENCH_REMOTE_DEADLINE_SECONDS", "1.5")
    server = faulty("drip", times=None, min_bytes=0, drip_seconds=0.1)
    with pytest.raises(RemoteError, match=r"the request's 1.5 s deadline passed with \d+ byte") as caught:
        wb.open_checkpoint(f"{server.url}/llama/")
    assert server.url in caught.value.message


def test_a_silent_server_is_announced_to_the_wait_hook(faulty, monkeypatch):
    monkeypatch.setenv("WORKBENCH_REMOTE_DEADLINE_SECONDS", "1.5")
    server = faulty("drip", times=None, min_bytes=0, drip_seconds=5)
    seen: list[tuple[str, float]] = []
    remote_limits.set_wait_hook(lambda host, seconds: seen.append((host, seconds)))
    try:
        with pytest.raises(RemoteError, match="deadline passed"):
            wb.open_checkpoint(f"{server.url}/llama/")
    finally:
        remote_limits.set_wait_hook(None)
    host = server.url.split("//", 1)[1]
    assert seen and all(h == host and s >= 0.3 for h, s in seen)


def test_a_conversion_bar_shows_the_wait_until_bytes_move():
    """While a conversion's bar is open, "waiting for <host>" is its postfix (not a log line through the bar);
    bytes moving clear it, and closing the bar gives the hook back."""
    from workbench.engine.progress import Progress

    progress = Progress(100, bar=True)
    remote_limits._notify("127.0.0.1:9", 6.0)
    assert "waiting for 127.0.0.1:9 (6 s without data)" in progress._bar.postfix
    progress.update(10, force=True)
    assert not progress._bar.postfix
    progress.close()
    assert remote_limits._wait_hook is None


def test_exact_content_range_and_identity_are_asked(faulty, served):
    """The honest path still works through the checked reader, and asks for an unencoded body."""
    server = faulty("none", times=0)
    ck = wb.open_checkpoint(f"{server.url}/llama/")
    assert len(ck.tensors) == 35
    assert all(r[2] in (200, 206) for r in server.requests())
    assert server.server.seen and all(h.get("Accept-Encoding") == "identity" for h in server.server.seen)


# --- the same modes in a child process under a 1 GiB address-space cap ---------------------------


# The child reports its own peak RSS (VmHWM of its address space) at exit: the rusage of a forked child also
# counts the parent's pages it started with, which says nothing about what the command itself used.
_WRAP = ("import atexit, runpy, sys\n"
         "atexit.register(lambda: sys.stderr.write(next(l for l in open('/proc/self/status') if l.startswith('VmHWM'))))\n"
         "sys.argv = ['workbench', *sys.argv[1:]]\n"
         "runpy.run_module('workbench', run_name='__main__', alter_sys=True)\n")


def _run_capped(*args: str, env: dict[str, str]) -> tuple[int, str, int]:
    """(exit status, stderr, peak RSS in bytes) of `python -m workbench ARGS` under `prlimit --as=1GiB`."""
    prlimit = shutil.which("prlimit")
    if prlimit is None:
        pytest.skip("prlimit (util-linux) is not installed")
    proc = subprocess.run([prlimit, "--as=1073741824", sys.executable, "-c", _WRAP, *args], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, env=env, cwd=REPO, timeout=120)
    stderr = proc.stderr.decode(errors="replace")
    m = re.search(r"VmHWM:\s+(\d+) kB\s*$", stderr)
    assert m, stderr
    return proc.returncode, stderr[: m.start()], int(m[1]) * 1024


def _child_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKBENCH_")}
    env.update(FAST, WORKBENCH_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(REPO))
    return env


@pytest.mark.serial  # measures peak RSS
@pytest.mark.parametrize("command", ["inspect", "convert"])
@pytest.mark.parametrize("mode", LYING)
def test_lying_server_under_an_address_space_cap(faulty, mode, command, tmp_path):
    lies_in_data = command == "convert" and mode != "size_mismatch"
    server = faulty(mode, times=None, min_bytes=FIRST_READ + 1 if lies_in_data else 0)
    args = [f"{server.url}/llama/"] + ([str(tmp_path / "out")] if command == "convert" else [])
    status, stderr, rss = _run_capped(command, *args, env=_child_env(tmp_path))
    assert status == 2, stderr
    assert "Traceback" not in stderr and server.url in stderr
    assert any(m in stderr for m in ("Cannot read", "Cannot look up")), stderr
    assert rss <= RSS_LIMIT, f"{mode}: peak RSS {rss / 2**20:.0f} MiB"


@pytest.mark.serial  # measures peak RSS
def test_inspect_of_a_server_ignoring_range_stops_at_the_budget(faulty, tmp_path):
    """D13: a 300 MB file answered whole to a 256 KiB range is refused before its body is read."""
    server = faulty("ignore_range", times=None, min_bytes=0)
    status, stderr, rss = _run_capped("inspect", f"{server.url}/big/model.safetensors", env=_child_env(tmp_path))
    assert status == 2 and "ignored the Range request" in stderr and "Traceback" not in stderr, stderr
    assert rss <= RSS_LIMIT, f"peak RSS {rss / 2**20:.0f} MiB"
    assert sum(r[3] for r in server.requests()) < 300 << 20  # the server could not send the whole file


# --- A6: redirects ------------------------------------------------------------------------------


def test_a_redirect_to_another_port_is_followed_and_named(faulty, tmp_path):
    from remote_servers import RedirectServer

    server = faulty("none", times=0)
    mover = RedirectServer(server.url)
    try:
        ck = wb.open_checkpoint(f"{mover.url}/llama/")
        plan = wb.plan(ck, dest=tmp_path / "out")
        final = server.url.split("//", 1)[1]
        assert f"served by {final} after a redirect" in plan.headline()[0]
        assert ck.load("model.norm.weight").numel() == 128
    finally:
        mover.stop()


def test_a_redirect_from_https_to_http_is_refused(faulty, tmp_path):
    from remote_servers import RedirectServer

    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed")
    cert = tmp_path / "cert.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(cert), "-out", str(cert)],
                   check=True, capture_output=True)
    server = faulty("none", times=0)
    mover = RedirectServer(server.url, certfile=str(cert))
    try:
        env = _child_env(tmp_path) | {"SSL_CERT_FILE": str(cert)}
        status, stderr, _ = _run_capped("inspect", f"{mover.url}/llama/", env=env)
    finally:
        mover.stop()
    assert status == 2 and "from https to http" in stderr and "Traceback" not in stderr, stderr
    assert server.requests() == []  # nothing was asked over plain http


def test_an_endless_hub_listing_stops_at_the_listing_cap(served, monkeypatch, tmp_path):
    """A1: a listing has no announced size; it is read within `LISTING_CAP` (512 MiB; 1 MiB here)."""
    root = tmp_path / "endpoint"
    (root / "api/models/org/llama/revision").mkdir(parents=True)
    (root / "api/models/org/llama/revision/main").write_text('{"id": "org/llama", "siblings": [')
    server = FaultyServer(root, "endless", times=None, min_bytes=0)
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setattr("workbench.formats.remote.LISTING_CAP", 1 << 20)
    try:
        with pytest.raises(RemoteError, match=r"larger than the 1048576-byte limit"):
            wb.open_checkpoint("hf://org/llama")
    finally:
        server.stop()
