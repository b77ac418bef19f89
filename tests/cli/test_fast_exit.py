"""`python -m workbench` leaves without the interpreter's tear-down only when nothing else wants the process."""

from __future__ import annotations

import atexit
import json
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from workbench.cli import fast_exit

# What `workbench convert --preset hf_to_fused` (a dim-0 fusion: byte copies only) must not import: start-up time a
# run measured against `cp -r` pays on every run (benchmarks/paired.py, workload `fuse`).
NOT_IMPORTED_BY_A_FUSION = ("torch", "numpy", "pandas", "workbench.mapper.merge", "workbench.mapper.presets.quantized",
                            "workbench.mapper.presets.gguf_preset", "workbench.mapper.presets.gptq", "workbench.output.gguf")


def _tensors(folder: Path) -> dict[str, bytes]:
    """Every tensor's raw bytes in the safetensors files of `folder`, read from the headers by hand."""
    found = {}
    for path in sorted(folder.glob("*.safetensors")):
        data = path.read_bytes()
        (size,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + size])
        for name, info in header.items():
            if name != "__metadata__":
                begin, end = info["data_offsets"]
                found[name] = data[8 + size + begin : 8 + size + end]
    return found


def test_fusion_from_the_shell_exits_cleanly_with_the_same_bytes(llama_sample: Path, tmp_path: Path) -> None:
    dest = tmp_path / "out"
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "workbench", "convert", str(llama_sample), str(dest),
                           "--preset", "hf_to_fused"], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Converted into" in done.stdout and "files opened match the plan: yes" in done.stdout  # flushed before leaving
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert not [name for name in NOT_IMPORTED_BY_A_FUSION if name in imported]
    source, out = _tensors(llama_sample), _tensors(dest)
    for layer in range(4):
        attn, mlp = f"model.layers.{layer}.self_attn.", f"model.layers.{layer}.mlp."
        assert out[attn + "qkv_proj.weight"] == b"".join(source[attn + p + "_proj.weight"] for p in "qkv")
        assert out[mlp + "gate_up_proj.weight"] == source[mlp + "gate_proj.weight"] + source[mlp + "up_proj.weight"]
    kept = {name: data for name, data in source.items() if not any(p in name for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))}
    assert {name: out[name] for name in kept} == kept
    assert not list(dest.glob("*.partial"))


def test_a_failing_command_keeps_its_status_and_message(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "workbench", "convert", str(tmp_path / "missing"), str(tmp_path / "out")],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 2 and "no such file or folder" in done.stderr


def test_code_around_run_module_keeps_running(llama_sample: Path) -> None:
    # A script that runs the command through runpy (as a test harness or a profiler does) gets control back.
    code = ("import runpy, sys\nsys.argv = ['workbench', 'plan', sys.argv[1]]\n"
            "try:\n    runpy.run_module('workbench', run_name='__main__', alter_sys=True)\n"
            "except SystemExit as exc:\n    print('AFTER', exc.code)\n")
    done = subprocess.run([sys.executable, "-c", code, str(llama_sample)], capture_output=True, text=True, check=False)
    assert "AFTER 0" in done.stdout, done.stderr[-2000:]


def test_no_quick_exit_when_exit_work_is_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    # Frames of `python -m workbench` are what `_started_for_this` accepts; here the checks after it decide.
    monkeypatch.setattr(fast_exit, "_started_for_this", lambda caller: True)
    monkeypatch.setattr(sys, "gettrace", lambda: None)  # pytest's coverage or a debugger may trace this process
    monkeypatch.setattr(sys, "getprofile", lambda: None)
    monkeypatch.setattr(atexit, "_ncallbacks", lambda: 0)
    monkeypatch.setattr(threading, "enumerate", lambda: [threading.main_thread()])
    monkeypatch.setattr(threading, "_threading_atexits", [], raising=False)
    assert fast_exit._quiet_exit_possible(None)
    monkeypatch.setattr(atexit, "_ncallbacks", lambda: 1)
    assert not fast_exit._quiet_exit_possible(None)
    monkeypatch.setattr(atexit, "_ncallbacks", lambda: 0)
    worker = threading.Thread(target=lambda: None)  # not started: only its daemon flag is asked
    monkeypatch.setattr(threading, "enumerate", lambda: [threading.main_thread(), worker])
    assert not fast_exit._quiet_exit_possible(None)
    worker.daemon = True
    assert fast_exit._quiet_exit_possible(None)


def test_a_nested_caller_is_not_the_process_entry() -> None:
    def inner() -> bool:
        return fast_exit._started_for_this(sys._getframe(0))

    assert not inner()  # pytest's frames sit above this one


def test_exit_now_raises_system_exit_when_it_may_not_leave_at_once() -> None:
    with pytest.raises(SystemExit) as raised:
        fast_exit.exit_now(3)  # called from pytest's frames: never the quick way
    assert raised.value.code == 3
