"""Shared fixtures: paths of the committed sample checkpoints and a factory of tiny checkpoints.

Checkpoints made by `tiny_checkpoint` are written with the reference `safetensors` writer (not the
package's own), so tests compare the workbench against an independent implementation.
"""

from __future__ import annotations

import filecmp
import importlib.util
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
SAMPLES = REPO / "sample_checkpoints"
INDEX_NAME = "model.safetensors.index.json"


_PREBUILD: list[subprocess.Popen] = []


def pytest_collection_finish(session: pytest.Session) -> None:
    """When GGUF tests will run, build their llama.cpp references in the background meanwhile (see
    tests/gguf_support/prebuild.py: it fills the core the rest of the suite leaves idle)."""
    if session.config.option.collectonly or importlib.util.find_spec("gguf") is None:
        return
    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0":  # under pytest-xdist, one pre-build (worker gw0's) for all
        return
    if not any("test_gguf" in item.nodeid for item in session.items):
        return
    log = REPO / ".cache" / "fixtures" / "gguf-prebuild.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with open(log, "w") as out:
        _PREBUILD.append(subprocess.Popen(["nice", "-n", "10", sys.executable, str(REPO / "tests" / "gguf_support" / "prebuild.py")],
                                          stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True))


# What runs alone: `make test` runs `pytest -n 2 --dist loadgroup` (pytest-xdist), and every test marked `serial` joins
# one xdist group, so serial tests run one after another on one worker while the other worker runs the rest. Tests
# that start torchrun or a JupyterLab + chromium (markers `distributed`, `browser`) are serial without saying it
# again: two of them at once would oversubscribe the two cores and time out; tests that measure a peak RSS mark
# themselves `serial`. What they measure is per process (a child's VmHWM; bytes read are the package's own
# per-process counters, workbench.iostats), so a unit test on the other worker does not change it; only two
# multi-process tests together would. `-m serial` / `-m "not serial"` select either part. `make test` runs the notebooks
# (nbval) in the same session: each notebook's cells form an xdist group of their own, so one worker runs them in order
# in one kernel while the other worker goes on with the rest.
SERIAL_MARKERS = ("serial", "distributed", "browser")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests carrying one of SERIAL_MARKERS `serial`, and put every serial test in one xdist group (run
    before pytest-xdist's own hook reads the groups)."""
    grouping = os.environ.get("PYTEST_XDIST_WORKER") is not None and bool(config.getvalue("loadgroup"))
    for item in items:
        group = None
        if any(item.get_closest_marker(name) for name in SERIAL_MARKERS):
            item.add_marker(pytest.mark.serial)
            group = "serial"
        elif item.nodeid.partition("::")[0].endswith(".ipynb"):  # nbval's cells of one notebook share one kernel
            group = "notebook_" + Path(item.nodeid.partition("::")[0]).stem
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
            if grouping:
                _join_xdist_group(item, group)


def _join_xdist_group(item: pytest.Item, group: str) -> None:
    """Give `item` the node id `ID@group` by which pytest-xdist's loadgroup scheduler groups it. pytest-xdist 3.8 writes
    `item._nodeid`, which pytest 9.2 no longer reads (a node id is `item._id`, a NodeId): with that pair every test
    was its own group and the `serial` tests ran on both workers at once. Writing the id here makes the group hold
    whichever of them is installed (a second `@group` suffix, were xdist to add one too, names the same group)."""
    nodeid = f"{item.nodeid}@{group}"
    try:
        from _pytest.nodeid import NodeId
    except ImportError:  # pytest before 9.2: xdist's own `_nodeid` rewrite works
        return
    item._id = NodeId.parse(nodeid)


# The group watch: a small process in pytest's own process group that logs every signal reaching the group. Run from
# a parent without job control (`make test` under CI), make, pytest and every child that does not start a session
# of its own share that group, and a SIGINT sent to it ends pytest as "interrupted" (exit status 2) with nothing
# saying who sent it. The watch says whether a signal came through the group (and when); tests start children that
# could signal their group in sessions of their own, and tests/launch/test_processes.py checks the launchers.
_GROUP_WATCH_CODE = r"""
import os, signal, sys, time
log, parent = sys.argv[1], int(sys.argv[2])

def note(signum, frame):
    with open(log, "a") as fh:
        fh.write(f"{time.strftime('%H:%M:%S')} {signal.Signals(signum).name}\n")

for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(sig, note)
print("READY", flush=True)
while os.getppid() == parent:  # ends with pytest, however pytest ends
    time.sleep(1)
"""
_GROUP_WATCH: list[tuple[subprocess.Popen, Path]] = []


def pytest_configure(config: pytest.Config) -> None:
    """Start the group watch (not in a collect-only run)."""
    import tempfile

    if config.option.collectonly or _GROUP_WATCH:
        return
    log = Path(tempfile.mkdtemp(prefix="workbench-group-watch-")) / "signals.log"
    watch = subprocess.Popen([sys.executable, "-c", _GROUP_WATCH_CODE, str(log), str(os.getpid())],
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    watch.stdout.readline()
    _GROUP_WATCH.append((watch, log))


def group_signals() -> str:
    """What the group watch logged so far ("" when no signal reached pytest's process group)."""
    return "".join(log.read_text() for _, log in _GROUP_WATCH if log.exists())


def pytest_keyboard_interrupt(excinfo: pytest.ExceptionInfo) -> None:
    """Say whether the interrupt came through the process group (and when), or to pytest alone / from inside."""
    seen = group_signals().strip()
    sys.stderr.write("\nworkbench tests: interrupted; signals that reached pytest's process group: "
                     + (seen.replace("\n", ", ") if seen else "none (the interrupt was sent to pytest alone, or raised inside it)") + "\n")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stop a pre-build still running (what it finished stays cached; what it was building is rebuilt next time),
    and the group watch, reporting any signal that reached the group."""
    for process in _PREBUILD:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=60)
    seen = group_signals().strip()
    if seen:
        sys.stderr.write(f"\nworkbench tests: signals reached pytest's process group during the run: {seen.replace(chr(10), ', ')}\n")
    while _GROUP_WATCH:
        watch, log = _GROUP_WATCH.pop()
        watch.kill()
        watch.wait()
        watch.stdout.close()
        import shutil

        shutil.rmtree(log.parent, ignore_errors=True)


_MEASURED_CLI = """
import json, runpy, sys
if sys.argv[1] == "whole":  # keep the planning's peak: the engine resets the high-water mark when its run starts
    import workbench.engine.rank as rank
    rank.reset_rss_peak = lambda: False
sys.argv = ["workbench", *sys.argv[2:]]
try:
    runpy.run_module("workbench", run_name="__main__", alter_sys=True)
except SystemExit as exit:
    assert not exit.code, exit.code
with open("/proc/self/status") as fh:  # this process's own high-water mark (ru_maxrss would include pytest's, inherited by fork)
    peak = next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:")) * 1024
print(json.dumps({"imported": [m for m in ("numpy", "torch", "transformers") if m in sys.modules], "peak": peak}))
"""


def run_cli_measured(args: list[str], whole_process: bool = False) -> tuple[set[str], int]:
    """Run `workbench ARGS` in a fresh process: (which of numpy, torch, transformers it imported, its peak RSS).
    `whole_process`: the peak includes planning, not only the run the engine measures."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", _MEASURED_CLI, "whole" if whole_process else "run", *args], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return set(result["imported"]), int(result["peak"])


def process_gone(pid: int) -> bool:
    """True when process `pid` has ended: no such process, or a zombie nobody reaped yet (a worker whose parent
    was killed is re-parented to the machine's init, which may reap it late or never). A bare `os.kill(pid, 0)`
    raced with that reaping."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            return fh.read().rsplit(")", 1)[-1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.fixture(scope="session")
def samples_dir() -> Path:
    """The folder holding the committed sample checkpoints."""
    return SAMPLES


@pytest.fixture(scope="session")
def llama_sample() -> Path:
    """HF-sharded tiny GQA Llama (4 layers, 3 shards + index, F32)."""
    return SAMPLES / "tiny-llama"


@pytest.fixture(scope="session")
def bert_sample() -> Path:
    """Single-file tiny BERT (`model.safetensors` + config.json, F32)."""
    return SAMPLES / "tiny-bert"


def load_checked(catalog: Any, name: str) -> Any:
    """Tensor `name` read through `catalog` (as torch), checking its byte count and that the byte range
    `catalog.locate` reports, when it reports one, holds exactly the bytes `read_bytes` returned."""
    import torch

    from workbench.dtypes import to_torch

    info = catalog[name]
    data = catalog.read_bytes(name)
    assert len(data) == info.nbytes
    located = catalog.locate(name)
    if located is not None:
        path, begin, end = located
        with open(path, "rb") as fh:
            fh.seek(begin)
            assert fh.read(end - begin) == data
    return torch.frombuffer(bytearray(data), dtype=to_torch(info.dtype)).reshape(info.shape) if data else torch.empty(info.shape, dtype=to_torch(info.dtype))


COMPLETION_RECORD = ".workbench-complete.json"  # run bookkeeping beside a finished output (see planning/destination.py)


def output_names(folder: Path) -> list[str]:
    """The names of a conversion's output folder, without the completion record (which stamps the run, not the output)."""
    return sorted(n for n in os.listdir(folder) if n != COMPLETION_RECORD)


def assert_same_folder(expected: Path, got: Path) -> None:
    """Both folders hold the same output file names with byte-identical contents."""
    assert output_names(got) == output_names(expected)
    for name in output_names(expected):
        assert filecmp.cmp(expected / name, got / name, shallow=False), f"{name} differs"


def load_safetensors_folder(folder: Path) -> dict[str, Any]:
    """Every tensor of every `.safetensors` file in `folder`, loaded by the reference safetensors reader."""
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(folder / name))
    return tensors

def plan_per_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plans made in this process after this call keep one step per tensor (no copy or cast runs), and even tiny
    files choose their data start by where their copies fall (`planning.page_align`), so comparisons with runs
    cover that choice too. Workers of a multi-rank run plan with the defaults."""
    from workbench.planning import page_align
    from workbench.planning import runs as copy_runs

    monkeypatch.setattr(copy_runs, "RUN_MIN_TENSORS", 10**9)
    monkeypatch.setattr(page_align, "ALIGN_MIN_BYTES", 64)


def plan_in_runs(monkeypatch: pytest.MonkeyPatch, run_tensors: int, tensor_bytes: int | None = None) -> None:
    """Plans made in this process after this call form runs of at most `run_tensors` (of tensors below
    `tensor_bytes`) from 1024 tensors on, with the page-alignment choice of `plan_per_tensor`."""
    from workbench.planning import page_align
    from workbench.planning import runs as copy_runs

    monkeypatch.setattr(page_align, "ALIGN_MIN_BYTES", 64)
    monkeypatch.setattr(copy_runs, "RUN_MIN_TENSORS", 1024)
    monkeypatch.setattr(copy_runs, "RUN_TENSORS", run_tensors)
    if tensor_bytes is not None:
        monkeypatch.setattr(copy_runs, "RUN_TENSOR_BYTES", tensor_bytes)


def planned_files(plan: Any) -> list[tuple]:
    """Each output file of `plan`: name, rank, tensor names in file order, header bytes."""
    return [(f.name, f.rank, [t.name for t in f.layout.tensors], f.layout.header) for f in plan.output_file_list]


def assert_same_outputs(a: Path, b: Path) -> None:
    """Two conversion outputs hold the same files with the same bytes (hidden run records aside)."""
    names = sorted(n for n in os.listdir(a) if not n.startswith("."))
    assert names == sorted(n for n in os.listdir(b) if not n.startswith("."))
    for name in names:
        assert filecmp.cmp(a / name, b / name, shallow=False), name



def llama_like_tensors(layers: int = 2, hidden: int = 8, dtype: Any = None, seed: int = 0) -> dict[str, Any]:
    """A small Llama-shaped state dict (GQA: k/v half the width of q), seeded, in name order."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    gen = torch.Generator().manual_seed(seed)
    kv = hidden // 2
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (16, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (hidden,),
                p + "self_attn.q_proj.weight": (hidden, hidden),
                p + "self_attn.k_proj.weight": (kv, hidden),
                p + "self_attn.v_proj.weight": (kv, hidden),
                p + "self_attn.o_proj.weight": (hidden, hidden),
                p + "post_attention_layernorm.weight": (hidden,),
                p + "mlp.gate_proj.weight": (2 * hidden, hidden),
                p + "mlp.up_proj.weight": (2 * hidden, hidden),
                p + "mlp.down_proj.weight": (hidden, 2 * hidden),
            }
        )
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (16, hidden)
    return {name: torch.randn(shape, generator=gen).to(dtype) for name, shape in shapes.items()}


def _write_checkpoint(
    where: Path, tensors: dict[str, Any], *, shards: int, single_file: bool, metadata: dict[str, str] | None
) -> Path:
    from safetensors.torch import save_file

    meta = {"format": "pt"} if metadata is None else metadata
    if single_file:
        where.mkdir(parents=True, exist_ok=True)
        path = where / "model.safetensors"
        save_file(tensors, str(path), metadata=meta)
        return path
    folder = where
    folder.mkdir(parents=True, exist_ok=True)
    if shards <= 1:
        save_file(tensors, str(folder / "model.safetensors"), metadata=meta)
        return folder
    names = list(tensors)
    per = -(-len(names) // shards)
    weight_map: dict[str, str] = {}
    total = 0
    for k in range(shards):
        part = names[k * per : (k + 1) * per]
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, str(folder / file), metadata=meta)
        for n in part:
            weight_map[n] = file
            total += tensors[n].numel() * tensors[n].element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return folder


@pytest.fixture
def tiny_checkpoint(tmp_path: Path) -> Callable[..., Path]:
    """Factory writing a small checkpoint under tmp_path with the reference safetensors writer.

    tiny_checkpoint(tensors=None, *, name="ckpt", shards=1, single_file=False, layers=2, hidden=8,
                    dtype=None, seed=0, metadata=None) -> Path
      tensors      dict name -> torch.Tensor; default: a Llama-like state dict (`layers`, `hidden`,
                   `dtype`, `seed` shape it)
      shards=1     a folder holding `model.safetensors`; shards=N>1: N shards + HF index
      single_file  return the path of one `.safetensors` file instead of a folder
    Returns the folder (or file) to open.
    """
    made: set[str] = set()

    def make(
        tensors: dict[str, Any] | None = None,
        *,
        name: str = "ckpt",
        shards: int = 1,
        single_file: bool = False,
        layers: int = 2,
        hidden: int = 8,
        dtype: Any = None,
        seed: int = 0,
        metadata: dict[str, str] | None = None,
    ) -> Path:
        if name in made:
            raise ValueError(f"tiny_checkpoint: name {name!r} already used in this test; pass another name")
        made.add(name)
        if tensors is None:
            tensors = llama_like_tensors(layers=layers, hidden=hidden, dtype=dtype, seed=seed)
        return _write_checkpoint(tmp_path / name, tensors, shards=shards, single_file=single_file, metadata=metadata)

    return make


@pytest.fixture
def tiny_tensors() -> Callable[..., dict[str, Any]]:
    """The default state-dict builder of `tiny_checkpoint`: tiny_tensors(layers=2, hidden=8, dtype=None, seed=0)."""
    return llama_like_tensors


@pytest.fixture(scope="session")
def lab_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """One JupyterLab server for every browser-test module (each works in its own folder: lab_harness.lab_folder)."""
    from lab_harness import JupyterLab

    server = JupyterLab(tmp_path_factory.mktemp("lab-root"), tmp_path_factory.mktemp("lab-state"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    """One headless chromium per browser-test module (tests/browser/, whose folder holds lab_harness)."""
    from lab_harness import launched_chromium

    with launched_chromium() as chromium:
        yield chromium
