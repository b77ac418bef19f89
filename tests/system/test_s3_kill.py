"""Kill -9 of a conversion into `s3://` (moto) at 20 random moments, then the same conversion again (issue 35).

Each run (a fork of one warm process) counts its S3 requests and file-system writes and SIGKILLs itself at event
number `kill_at` (as a kill from outside at that moment would: no cleanup). After each kill the prefix is either not yet visible (no index) or
complete and byte-identical to the local conversion; the re-run then finishes it, identical, and leaves no
multipart upload behind.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from remote_servers import MotoS3, folder_files, s3_destination_env, s3_server  # noqa: F401 - fixtures s3, _env
from safetensors.numpy import save_file

import workbench as wb

pytestmark = pytest.mark.serial

INDEX = "model.safetensors.index.json"
KILLS = 20
OPTIONS = dict(shard_size="6MiB", spool_size="8MiB", remote_options={"part_size": "5MiB"})

# The runs are forks of one process: a fresh interpreter per run spent most of its second starting and importing.
# The first run (no kill) writes which modules the conversion imported; the fork server imports the package's and
# s3fs's (most of that import time) before the next forks, so each killed run starts with them loaded. It forks only
# while it has no other thread (a clean copy).
FORK_SERVER = r"""
import importlib, json, os, signal, sys, threading
import workbench as wb
from workbench.output.remote.s3 import S3Destination
source, options = sys.argv[1], json.loads(sys.argv[2])

def run(url, kill_at, log):
    events, counting = [0], threading.Lock()

    def counted(fn):
        def call(*args, **kwargs):
            with counting:
                events[0] += 1
                if events[0] == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
            return fn(*args, **kwargs)
        return call

    S3Destination.call = counted(S3Destination.call)
    for name in ("pwrite", "copy_file_range", "fsync", "replace", "unlink"):
        setattr(os, name, counted(getattr(os, name)))
    wb.convert(source, url, quiet=True, **options)
    print("EVENTS", events[0])
    if not kill_at:
        with open(log + ".modules", "w") as fh:
            fh.write("\n".join(sorted(sys.modules)))

for line in iter(sys.stdin.readline, ""):
    url, kill_at, log = line.split()
    assert threading.active_count() == 1, threading.enumerate()
    pid = os.fork()
    if pid == 0:
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(out, 1)
        os.dup2(out, 2)
        run(url, int(kill_at), log)
        sys.exit(0)
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if os.path.exists(log + ".modules"):
        for name in open(log + ".modules").read().split():
            if name.split(".")[0] in ("workbench", "s3fs"):  # not all: that broke the next run's S3 client
                importlib.import_module(name)
    print(status, flush=True)
"""


class ForkServer:
    """Runs the conversion of `source` into a URL in a fork of one warm process, killed at a chosen event."""

    def __init__(self, source: Path, logs: Path) -> None:
        self.logs = logs
        self.process = subprocess.Popen([sys.executable, "-c", FORK_SERVER, str(source), json.dumps(OPTIONS)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def run(self, url: str, kill_at: int) -> tuple[int, str]:
        """(exit status, -9 when killed; what the run printed) of the conversion into `url` killed at event `kill_at`
        (0: never)."""
        log = self.logs / f"run-{kill_at}.log"
        self.process.stdin.write(f"{url} {kill_at} {log}\n")  # type: ignore[union-attr]
        self.process.stdin.flush()  # type: ignore[union-attr]
        status = self.process.stdout.readline()  # type: ignore[union-attr]
        assert status, f"the fork server ended (status {self.process.wait()})"
        return int(status), log.read_text()

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.stdin.close()  # type: ignore[union-attr]
        self.process.wait(timeout=60)
        self.process.stdout.close()  # type: ignore[union-attr]


def test_a_killed_upload_is_invisible_or_complete_and_the_rerun_finishes_it(s3: MotoS3, tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    rng = np.random.default_rng(7)
    tensors = {f"layers.{i}.weight": rng.standard_normal((512, 1024), dtype=np.float32) for i in range(4)}  # 8 MiB
    names = list(tensors)
    for k in range(2):  # -> a 6 MiB file (a multipart upload of two parts) and a 2 MiB one (one PUT)
        save_file({n: tensors[n] for n in names[2 * k:2 * k + 2]}, str(source / f"model-{k + 1:05d}-of-00002.safetensors"))
    (source / "config.json").write_text(json.dumps({"model_type": "llama"}))
    wb.convert(source, tmp_path / "local", quiet=True, shard_size="6MiB")
    reference = folder_files(tmp_path / "local")
    bucket = s3.bucket()

    with ForkServer(source, tmp_path) as forks:
        status, printed = forks.run(f"s3://{bucket}/clean/", 0)
        assert status == 0, printed[-2000:]
        total = int(printed.split("EVENTS")[-1])
        assert s3.output(bucket, "clean") == reference and total > KILLS

        moments = sorted(random.Random(35).sample(range(1, total + 1), KILLS))
        outcomes = []
        for k, kill_at in enumerate(moments):
            prefix = f"run{k}"
            url = f"s3://{bucket}/{prefix}/"
            status, printed = forks.run(url, kill_at)
            assert status in (0, -9), printed[-2000:]
            found = s3.output(bucket, prefix)
            if INDEX in found:  # visible means complete: every file the index names is there, byte for byte
                assert found == reference, f"kill at event {kill_at}: an index is visible beside incomplete files"
                outcomes.append("complete")
            else:
                with pytest.raises(Exception):  # noqa: B017 - nothing there opens as a finished checkpoint
                    wb.open_checkpoint(url).tensors  # noqa: B018
                outcomes.append("invisible")
            wb.convert(source, url, quiet=True, **OPTIONS)  # the same conversion again: resumes and finishes
            assert s3.output(bucket, prefix) == reference, f"kill at event {kill_at}: the re-run differs"
            assert [key for key in s3.uploads(bucket) if key.startswith(prefix + "/")] == [], f"kill at event {kill_at}"
        assert outcomes.count("invisible") >= KILLS // 2, outcomes  # most moments fall before the index
        print("S3 kill outcomes:", outcomes)
