"""A `Function` defined in the main program (a notebook cell, the script being run) on several ranks (issue 29, D12).

Workers are other processes: their `__main__` is the worker, not the user's program, so `'__main__:fn'`
cannot be found there; before, two local ranks failed with "this worker's plan differs... Run it again",
forever. The plan now refuses it up front, saying to define the function in a module; a function in a
module runs on two ranks exactly as on one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import workbench as wb
from workbench import mapper as M
from workbench.errors import PlanError

SCRIPT = """
import sys
import workbench as wb
from workbench import mapper as M
from workbench.errors import WorkbenchError

def double(tensor):
    return tensor * 2

if __name__ == "__main__":
    source, dest, nproc, reference = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    if len(sys.argv) > 5:  # a notebook's habit: make a folder of modules importable at run time
        sys.path.insert(0, sys.argv[5])
    mapper = M.Function(reference, ["model.norm.weight"], ["model.norm.weight"])
    try:
        wb.convert(source, dest, mapper, nproc=nproc, launcher="local", shard_size="100KB", quiet=True)
    except WorkbenchError as exc:
        print(exc, file=sys.stderr)
        sys.exit(2)
    print("converted")
"""


def _run(folder: Path, args: list[str], module: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "userscript"] if module else [sys.executable, str(folder / "userscript.py")]
    return subprocess.run([*command, *args], capture_output=True, text=True, env=env, cwd=folder, timeout=240)


def _run_elsewhere(folder: Path, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """The script run by path from another folder, PYTHONPATH as the tests have it: `lib/` is importable only
    because the script adds it to sys.path itself."""
    return subprocess.run([sys.executable, str(folder / "userscript.py"), *args], capture_output=True, text=True,
                          cwd=cwd, timeout=240)


@pytest.fixture
def script(tmp_path: Path) -> Path:
    folder = tmp_path / "user"
    folder.mkdir()
    (folder / "userscript.py").write_text(SCRIPT)
    (folder / "usermodule.py").write_text("def double(tensor):\n    return tensor * 2\n")
    (folder / "lib").mkdir()
    (folder / "lib" / "libmodule.py").write_text("def double(tensor):\n    return tensor * 2\n")
    return folder


def test_a_main_program_function_on_two_local_ranks_is_refused_at_plan_time(llama_sample: Path, script: Path,
                                                                            tmp_path: Path) -> None:
    dest = tmp_path / "out"
    done = _run(script, [str(llama_sample), str(dest), "2", "__main__:double"])
    assert done.returncode == 2, done.stdout + done.stderr[-3000:]
    message = done.stderr
    assert "Cannot run Function '__main__:double' on 2 ranks" in message
    assert "Define it in a module (a .py file importable by the workers)" in message and "nproc=1" in message
    assert "differs" not in message and "Traceback" not in message
    assert not dest.exists()  # refused before anything was written
    # Run as `python -m userscript`, the message names what to write instead.
    again = _run(script, [str(llama_sample), str(dest), "2", "__main__:double"], module=True)
    assert again.returncode == 2 and "name it 'userscript:double'" in again.stderr, again.stderr[-3000:]


def test_the_same_function_in_a_module_runs_on_two_ranks(llama_sample: Path, script: Path, tmp_path: Path) -> None:
    from tests.conftest import load_safetensors_folder

    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    # a module found through a sys.path entry the program added at run time: its folder travels to the workers
    two = _run_elsewhere(script, [str(llama_sample), str(tmp_path / "two"), "2", "libmodule:double", str(script / "lib")],
                         elsewhere)
    assert two.returncode == 0, two.stderr[-3000:]
    before, after = load_safetensors_folder(llama_sample), load_safetensors_folder(tmp_path / "two")
    assert sorted(after) == sorted(before)
    for name, tensor in before.items():
        expected = tensor * 2 if name == "model.norm.weight" else tensor
        assert (after[name] == expected).all(), name


def double(tensor):
    return tensor * 2


def test_plan_problem_in_process(llama_sample: Path, tmp_path: Path) -> None:
    """The refusal is a plan problem (seen in a dry run), for `__main__` and for modules the workers cannot import."""
    mapper = M.Function("__main__:double", ["model.norm.weight"], ["model.norm.weight"])
    plan = wb.plan(llama_sample, mapper, nproc=2)
    assert not plan.ok and any("define it in a module" in p.message.lower() for p in plan.errors)
    missing = M.Function("no_such_module_here:double", ["model.norm.weight"], ["model.norm.weight"],
                         infer="tests.mapper.test_function:_same")
    plan = wb.plan(llama_sample, missing, nproc=2)
    assert any("'no_such_module_here' of" in p.message for p in plan.errors)
    with pytest.raises(PlanError, match="on 2 ranks"):
        wb.convert(llama_sample, tmp_path / "out", mapper, nproc=2, quiet=True)
    assert not (tmp_path / "out").exists()


def _same(info):
    return [(info.dtype, info.shape)]
