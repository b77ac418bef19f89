"""A remote pass-through conversion's predicted RSS covers what it uses (issue 29 D15): `workbench convert URL` in a
child process, predicted >= measured and within 15 %, and the report blames nothing that did not happen."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from remote_servers import FaultyServer
from safetensors.numpy import save_file

REPO = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.serial  # measures peak RSS: run alone (see conftest.SERIAL_MARKERS)


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Path:
    """4 shards of 40 MiB of F32 noise (160 MiB): more than the reader's window, in several ranges per shard."""
    root = tmp_path_factory.mktemp("served")
    folder = root / "m"
    folder.mkdir()
    rng = np.random.default_rng(0)
    weight_map = {}
    for k in range(4):
        name = f"model-{k + 1:05d}-of-00004.safetensors"
        tensors = {f"layers.{k}.{j}.weight": rng.standard_normal((1280, 2048), dtype=np.float32) for j in range(4)}
        save_file(tensors, str(folder / name))
        weight_map.update(dict.fromkeys(tensors, name))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


def test_remote_pass_through_rss_is_predicted(served, tmp_path):
    server = FaultyServer(served, "none", times=0)
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("WORKBENCH_")}
        env.update(WORKBENCH_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(REPO))
        done = subprocess.run([sys.executable, "-m", "workbench", "convert", f"{server.url}/m/", str(tmp_path / "out")],
                              capture_output=True, text=True, env=env, cwd=REPO, timeout=240)
    finally:
        server.stop()
    assert done.returncode == 0, done.stderr
    m = re.search(r"RSS peak\s+([\d.]+) MiB\s+([\d.]+) MiB", done.stdout)
    assert m, done.stdout
    predicted, measured = float(m[1]), float(m[2])
    print(f"predicted {predicted} MiB, measured {measured} MiB")
    assert measured <= predicted <= 1.15 * measured, (predicted, measured)
    assert "notebook" not in done.stdout + done.stderr
