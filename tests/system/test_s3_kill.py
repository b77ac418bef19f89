"""Kill -9 of a conversion into `s3://` (moto) at 20 random moments, then the same conversion again (issue 35).

The child counts its S3 requests and file-system writes and SIGKILLs itself at event number `kill_at` (as a kill
from outside at that moment would: no cleanup). After each kill the prefix is either not yet visible (no index) or
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

CHILD = r"""
import json, os, signal, sys, threading
import workbench as wb
from workbench.output.remote.s3 import S3Destination
kill_at, events, counting = int(sys.argv[3]), [0], threading.Lock()

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
wb.convert(sys.argv[1], sys.argv[2], quiet=True, **json.loads(sys.argv[4]))
print("EVENTS", events[0])
"""


def _child(source: Path, url: str, kill_at: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHILD, str(source), url, str(kill_at), json.dumps(OPTIONS)],
                          capture_output=True, text=True, timeout=120)


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

    clean = _child(source, f"s3://{bucket}/clean/", 0)
    assert clean.returncode == 0, clean.stderr[-2000:]
    total = int(clean.stdout.split("EVENTS")[-1])
    assert s3.output(bucket, "clean") == reference and total > KILLS

    moments = sorted(random.Random(35).sample(range(1, total + 1), KILLS))
    outcomes = []
    for k, kill_at in enumerate(moments):
        prefix = f"run{k}"
        url = f"s3://{bucket}/{prefix}/"
        killed = _child(source, url, kill_at)
        assert killed.returncode in (0, -9), killed.stderr[-2000:]
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
