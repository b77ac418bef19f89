"""Measure the start-up memory of conversion processes: the constants of `workbench/planning/rss_calibration.py`.

The RSS prediction (`plan.rss_bytes`) adds, to the plan's tensor bytes, what a process costs before it
holds any tensor: the interpreter, the modules its entry point imports, numpy or torch when its steps need
them, and the catalog and plan per source tensor. Those are measured here, on conversions of tiny
checkpoints (so their tensor bytes are negligible), as the kernel's peak RSS of each process
(the number `/usr/bin/time -v` prints as "Maximum resident set size"):

    interpreter   python -c pass
    cli           workbench convert, byte copies, N_SMALL tensors      - interpreter - metadata
    per tensor    (the same with N_LARGE tensors - with N_SMALL) / (N_LARGE - N_SMALL)
    numpy         workbench convert --dtype bf16 (numpy casts)         - the byte-copy run
    torch         workbench convert --mapper transpose.py (torch ops)  - the byte-copy run
    worker        a worker's peak RSS in a 2-process byte-copy run     - interpreter - metadata

A library's resident pages depend on the size of the page-cache folios holding its shared objects, not on the
venv's age as such: a page fault maps the whole folio it hits (a 2 MiB one by a PMD), and on kernels whose page
cache uses large folios (ext4 on Linux >= 6.16, xfs) a file written in large chunks (a pip install, a copy) or
read through with read() sits in folios of up to 2 MiB, while pages the loader faulted in after an eviction sit
in small ones. torch then costs ~75 MiB more (libtorch_cpu.so: 127 MiB resident instead of 51). The plan
predicts the larger state, so every run here imports its libraries from a private mirror of site-packages
(`mirror_site_packages`: real folders, the shared objects copied with 32 MiB writes, so every one of their
folios is as large as the kernel makes them; everything else symlinked). Measured in a private copy, the state
does not depend on the venv this runs in: the venv's own files may be mapped by other processes, which keeps
them in whatever folios they have (posix_fadvise cannot evict a mapped page). numpy and torch are then measured
once more with the mirror's shared objects evicted (faulted in by the import, the small state): the difference
is LIBRARY_SPREAD.

Besides the convert runs above, in-process drivers measure what the plan adds on top for a remote source's
transport (REMOTE_LIBRARIES: import and construction of the http, hf and s3 stores, no request) and for a recipe
built from transformers' registry (TRANSFORMERS_BYTES: what `M.presets.from_transformers` on a scaled-down
DeepSeek-V3 folder leaves resident on top of torch).

Each run is repeated (--repeat, median kept). Usage:
    python scripts/calibrate_rss.py            # print the measured constants next to the current ones
    python scripts/calibrate_rss.py --write    # and rewrite workbench/planning/rss_calibration.py
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIME = "/usr/bin/time"
TARGET = ROOT / "workbench" / "planning" / "rss_calibration.py"
N_SMALL = 200
N_LARGE = 20200
WRITE_CHUNK = 32 << 20  # a write this large is cached in the largest folios the file system makes (2 MiB, PMD-mapped)
SCHEMES = ("http", "hf", "s3")
# What row jobs import on top of numpy: the gguf package (with ml_dtypes), ml_dtypes alone. Only ml_dtypes is written
# (ML_DTYPES_BYTES); the gguf figure is printed beside gguf_rows.GGUF_LIBRARIES: measured so (9.4 MB against 8.1) it
# tips test_gguf_inverse's lower bound, where the whole prediction already sits ~23 % above the measured peak.
ROW_LIBRARIES = ("gguf", "ml_dtypes")


def environment(mirror: Path | None) -> dict[str, str]:
    """This process's environment with the repository, then `mirror` (the copy of site-packages), first on the path."""
    paths = [str(ROOT), str(mirror) if mirror else "", os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths))}


ENV = environment(None)


def is_shared_object(path: Path) -> bool:
    """True for the files the dynamic loader maps (`x.so`, `libx.so.1.2`)."""
    return path.name.endswith(".so") or ".so." in path.name


def write_large(src: Path, dest: Path) -> None:
    """Copy `src` to `dest` in WRITE_CHUNK writes: the copy's pages enter the page cache in the largest folios."""
    with open(src, "rb") as fin, open(dest, "wb") as fout:
        while chunk := fin.read(WRITE_CHUNK):
            fout.write(chunk)
    shutil.copymode(src, dest)


def rewrite_large(files: list[Path]) -> None:
    """Write each of `files` again by `write_large` (a new file renamed over it): its pages back in the largest folios."""
    for file in files:
        fresh = file.with_name(file.name + ".rewrite")
        write_large(file, fresh)
        os.replace(fresh, file)


def mirror_site_packages(dest: Path, site: Path | None = None) -> list[Path]:
    """Mirror `site` (this interpreter's site-packages) in `dest`: each top-level entry holding a shared object is
    rebuilt with real folders, its shared objects copied by `write_large`, its other files and its `__pycache__`
    folders (so nothing is compiled again) symlinked; other entries are symlinked whole. On the path before
    `site`, the mirror's copies are what imports map. Returns the copied shared objects."""
    site = Path(site or sysconfig.get_paths()["platlib"])
    dest.mkdir(parents=True, exist_ok=True)
    copied: list[Path] = []
    for entry in sorted(site.iterdir()):
        target = dest / entry.name
        if entry.is_symlink() or not entry.is_dir() or not any(is_shared_object(f) for f in entry.rglob("*.so*")):
            target.symlink_to(entry)
            continue
        for folder, subdirs, files in os.walk(entry):
            here = target / Path(folder).relative_to(entry)
            here.mkdir(exist_ok=True)
            if "__pycache__" in subdirs:
                subdirs.remove("__pycache__")
                (here / "__pycache__").symlink_to(Path(folder) / "__pycache__")
            for name in files:
                src = Path(folder) / name
                if is_shared_object(src) and not src.is_symlink():
                    write_large(src, here / name)
                    copied.append(here / name)
                else:
                    (here / name).symlink_to(src)
    return copied


def resident_bytes(path: Path) -> int:
    """Bytes of `path` in the page cache (mincore on a read-only map of it)."""
    size = path.stat().st_size
    if size == 0:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    page = os.sysconf("SC_PAGE_SIZE")
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"Cannot map {path}")
        try:
            vec = ctypes.create_string_buffer((size + page - 1) // page)
            if libc.mincore(address, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"Cannot read the page-cache state of {path}")
            return sum(b & 1 for b in vec.raw) * page
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)


def evict(files: list[Path]) -> None:
    """Drop `files` from the page cache; the next import faults their pages in (small folios). Fails when pages
    stay (a process maps them): the faulted state would then not be the one measured."""
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    left = sum(resident_bytes(f) for f in files)
    if left > 1 << 20:
        raise SystemExit(f"Cannot calibrate: {left / 2**20:.0f} MiB of the mirror's shared objects stay cached after "
                         "eviction (a process maps them). Stop it and re-run.")


def peak_rss(argv: list[str], env: dict[str, str] | None = None) -> int:
    """Peak RSS in bytes of a process, as `/usr/bin/time` reports it ("Maximum resident set size").

    Not `os.wait4` from this process: a child forked from a large parent starts with the parent's
    high-water mark (the kernel keeps it across exec), so only a small launcher gives the child's own.
    """
    if not os.access(TIME, os.X_OK):
        raise SystemExit(f"Cannot calibrate: {TIME} is missing. Install it (Debian: apt-get install time).")
    proc = subprocess.run([TIME, "-f", "%M", *argv], env=env or ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)
    if proc.returncode != 0:
        raise SystemExit(f"Cannot calibrate: {' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return int(proc.stderr.strip().splitlines()[-1]) * 1024


def median_of(repeat: int, measure) -> int:
    return int(statistics.median(measure() for _ in range(repeat)))


def tiny_checkpoint(folder: Path, count: int) -> Path:
    """`count` small float32 tensors with Llama-like names in one model.safetensors."""
    import numpy as np
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {f"model.layers.{i // 8}.block_{i % 8}.proj.weight": np.full((8, 8), i % 7, np.float32) for i in range(count)}
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


# The scaled-down DeepSeek-V3 of tests/system/test_moe_scaled.py (headers only): what from_transformers is measured on.
SCALED_DEEPSEEK = {"vocab_size": 512, "hidden_size": 1024, "intermediate_size": 2048, "moe_intermediate_size": 1024,
                   "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 8, "n_routed_experts": 16,
                   "kv_lora_rank": 128, "q_lora_rank": 256, "qk_rope_head_dim": 128, "v_head_dim": 64,
                   "qk_nope_head_dim": 64, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 2,
                   "first_k_dense_replace": 1, "max_position_embeddings": 256}


def scaled_deepseek(folder: Path) -> Path:
    """Write the scaled-down DeepSeek-V3 folder (config.json and headers, data as holes)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import make_sparse_moe
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    make_sparse_moe.make_moe(folder, "deepseek_v3", {**make_sparse_moe.CONFIGS["deepseek_v3"], **SCALED_DEEPSEEK}, n_shards=3)
    return folder


def convert_argv(src: Path, dest: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "workbench", "convert", str(src), str(dest), "--overwrite", *extra]  # with its progress bar, as users run it


WORKER_DRIVER = """
import json, sys
import workbench as wb
report = wb.convert(sys.argv[1], sys.argv[2], nproc=2, launcher="local", quiet=True, overwrite=True)
print(json.dumps([r.rss_peak for r in report.ranks]))
"""

# What a process already running the workbench CLI (and torch, for transformers) adds by one step, in bytes: a
# transport's peak (VmHWM) for a scheme; what stays resident (VmRSS: the engine resets the peak when its run
# starts) for a recipe built from transformers' registry. Also where libtorch was mapped from (the mirror check).
ADDED_DRIVER = """
import json, sys
def status(key):
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(key + ":")) * 1024
import workbench.cli.commands
what = sys.argv[1]
if what == "transformers":
    import torch
    torch.ones(8, 8).t().contiguous().to(torch.bfloat16)
if what in ("gguf", "ml_dtypes"):  # on top of numpy, imported and used, as a conversion's row jobs run
    import numpy as np
    np.ones((64, 64), np.float32).astype(np.float16)
    with open("/proc/self/clear_refs", "w") as fh:  # the peak so far is the baseline's, not the library's: reset it
        fh.write("5")
before = status("VmRSS")
if what == "gguf":  # a Q8_0 quantisation, as gguf_rows converts
    import gguf
    import ml_dtypes
    gguf.quants.quantize(np.linspace(-1, 1, 32 * 256, dtype=np.float32).reshape(32, 256), gguf.GGMLQuantizationType.Q8_0)
    np.zeros(256, np.float32).astype(ml_dtypes.bfloat16)
    added = status("VmHWM") - before
elif what == "ml_dtypes":  # an FP4 decode, as the MXFP4 row jobs do
    import ml_dtypes
    np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    (np.arange(256, dtype=np.uint8) & 15).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    added = status("VmHWM") - before
elif what == "transformers":
    from workbench import mapper as M
    M.presets.from_transformers(sys.argv[2])
    added = status("VmRSS") - before
else:
    from workbench.formats.remote import HttpStore, s3_filesystem
    if what == "s3":
        s3_filesystem()
    else:
        HttpStore("http://127.0.0.1:9/model")
    if what == "hf":
        from huggingface_hub import constants, hf_hub_url
        from huggingface_hub.utils import build_hf_headers
        build_hf_headers()
    added = status("VmHWM") - before
with open("/proc/self/maps") as fh:
    mapped = sorted({line.split()[-1] for line in fh if "libtorch_cpu" in line})
print(json.dumps({"added": added, "libtorch": mapped}))
"""


def worker_peak(src: Path, dest: Path, env: dict[str, str] | None = None) -> int:
    """The largest worker's peak RSS (its own measurement) in a 2-process byte-copy run."""
    out = subprocess.run([sys.executable, "-c", WORKER_DRIVER, str(src), str(dest)], env=env or ENV, check=True,
                         capture_output=True, text=True)
    return max(json.loads(out.stdout.strip().splitlines()[-1]))


def added_bytes(env: dict[str, str], mirror: Path, *args: str) -> int:
    """What `ADDED_DRIVER` measures for `args`; fails when torch was mapped from elsewhere than the mirror."""
    out = subprocess.run([sys.executable, "-c", ADDED_DRIVER, *args], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"Cannot calibrate: measuring {args[0]} failed:\n{out.stderr[-2000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if any(not path.startswith(str(mirror)) for path in result["libtorch"]):
        raise SystemExit(f"Cannot calibrate: torch was mapped from {result['libtorch']}, not from the mirror {mirror}.")
    return int(result["added"])


def library_files(copied: list[Path], mirror: Path, name: str) -> list[Path]:
    """The mirror's shared objects of library `name` (its package and its `name.libs` folder)."""
    roots = (mirror / name, mirror / f"{name}.libs")
    return [f for f in copied if any(f.is_relative_to(root) for root in roots)]


def measure(repeat: int) -> dict:
    """Every constant, in bytes, the libraries imported from a private mirror of site-packages (the large state)."""
    with tempfile.TemporaryDirectory(prefix="wb-rss-") as tmp:
        work = Path(tmp)
        mirror = work / "site-packages"
        copied = mirror_site_packages(mirror)
        env = environment(mirror)
        small = tiny_checkpoint(work / "small", N_SMALL)
        large = tiny_checkpoint(work / "large", N_LARGE)
        deepseek = scaled_deepseek(work / "deepseek")
        transpose = work / "transpose.py"
        transpose.write_text("from workbench import mapper as M\nmapper = M.Transpose('model.layers.{i}.block_0.proj.weight')\n")
        out = work / "out"

        def peak(argv: list[str]) -> int:
            return median_of(repeat, lambda: peak_rss(argv, env))

        interpreter = peak([sys.executable, "-c", "pass"])
        copy_small = peak(convert_argv(small, out))
        copy_large = peak(convert_argv(large, out))
        runs = {"numpy": convert_argv(small, out, "--dtype", "bf16"), "torch": convert_argv(small, out, "--mapper", str(transpose))}
        library = {name: max(0, peak(argv) - copy_small) for name, argv in runs.items()}
        worker = median_of(repeat, lambda: worker_peak(small, out, env))
        remote = {scheme: median_of(repeat, lambda s=scheme: added_bytes(env, mirror, s)) for scheme in SCHEMES}
        transformers = median_of(repeat, lambda: added_bytes(env, mirror, "transformers", str(deepseek)))
        row_libraries = {name: median_of(repeat, lambda n=name: added_bytes(env, mirror, n)) for name in ROW_LIBRARIES}
        spread = {}
        for name, argv in runs.items():  # the small state: the library's shared objects faulted in by the import
            evict(library_files(copied, mirror, name))
            spread[name] = max(0, library[name] - max(0, peak(argv) - copy_small))
    per_tensor = max(0, (copy_large - copy_small) // (N_LARGE - N_SMALL))
    return {
        "INTERPRETER": interpreter,
        "WORKBENCH": {
            "cli": copy_small - interpreter - per_tensor * N_SMALL,
            "worker": worker - interpreter - per_tensor * N_SMALL,
        },
        "LIBRARY": library,
        "LIBRARY_SPREAD": spread,
        "PER_TENSOR": per_tensor,
        "REMOTE_LIBRARIES": remote,
        "TRANSFORMERS_BYTES": transformers,
        "ROW_LIBRARIES": row_libraries,
    }


def versions() -> str:
    import numpy
    import torch

    return (f"{platform.system()} {platform.machine()} (kernel {platform.release()}), CPython "
            f"{platform.python_version()}, numpy {numpy.__version__}, torch {torch.__version__}")


def measured_with() -> dict[str, str]:
    """The versions the constants hold for (what planning.rss compares with the installed ones)."""
    from importlib.metadata import version

    return {"python": platform.python_version(), "numpy": version("numpy"), "torch": version("torch")}


def module_text(values: dict, repeat: int) -> str:
    """The calibration module, as `--write` leaves it."""
    remote = ", ".join(f'"{k}": {v}' for k, v in values["REMOTE_LIBRARIES"].items())
    return f'''"""Measured memory of conversion processes before they hold any tensor (bytes): what `planning.rss` adds to
the plan's tensor peak. Written by `python scripts/calibrate_rss.py --write` (see it for how each number is
measured: peak RSS of real `workbench convert` runs on tiny checkpoints, median of {repeat}, the libraries' shared
objects in the page-cache state that maps the most of them, whatever the state of the venv it ran in); re-run it
after a Python, numpy, torch or transformers upgrade, or on a new platform.

Measured {date.today().isoformat()} on {versions()}.
"""

INTERPRETER = {values["INTERPRETER"]}  # python -c pass
WORKBENCH = {{"cli": {values["WORKBENCH"]["cli"]}, "worker": {values["WORKBENCH"]["worker"]}}}  # the entry point's modules and run state
LIBRARY = {{"numpy": {values["LIBRARY"]["numpy"]}, "torch": {values["LIBRARY"]["torch"]}}}  # added by importing and using each (the large page-cache state)
LIBRARY_SPREAD = {{"numpy": {values["LIBRARY_SPREAD"]["numpy"]}, "torch": {values["LIBRARY_SPREAD"]["torch"]}}}  # how much less each costs when its files were paged in by faults
PER_TENSOR = {values["PER_TENSOR"]}  # catalog and plan, per source tensor
REMOTE_LIBRARIES = {{{remote}}}  # a remote source's transport (fsspec, aiohttp; huggingface_hub; s3fs, botocore), imported and set up
TRANSFORMERS_BYTES = {values["TRANSFORMERS_BYTES"]}  # transformers and its conversion modules, left resident by M.presets.from_transformers
ML_DTYPES_BYTES = {values["ROW_LIBRARIES"]["ml_dtypes"]}  # ml_dtypes imported and used (an FP8 and an FP4 decode) on top of numpy
MEASURED_WITH = {measured_with()!r}  # planning.rss.calibration_mismatch compares these with what is installed
'''


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite {TARGET.relative_to(ROOT)}")
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement (median kept)")
    args = parser.parse_args(argv)
    values = measure(args.repeat)
    sys.path.insert(0, str(ROOT))
    from workbench.planning import rss_calibration as current

    def mib(n: int) -> str:
        return f"{n / 2**20:.1f} MiB"

    rows = [("interpreter", current.INTERPRETER, values["INTERPRETER"])]
    rows += [(f"workbench ({k})", current.WORKBENCH[k], v) for k, v in values["WORKBENCH"].items()]
    rows += [(k, current.LIBRARY[k], v) for k, v in values["LIBRARY"].items()]
    rows += [(f"{k} spread", getattr(current, "LIBRARY_SPREAD", {}).get(k, 0), v) for k, v in values["LIBRARY_SPREAD"].items()]
    rows += [(f"{k} transport", getattr(current, "REMOTE_LIBRARIES", {}).get(k, 0), v) for k, v in values["REMOTE_LIBRARIES"].items()]
    rows.append(("transformers recipe", getattr(current, "TRANSFORMERS_BYTES", 0), values["TRANSFORMERS_BYTES"]))
    from workbench.mapper.presets.gguf_rows import (
        GGUF_LIBRARIES,  # hand-set there (see ROW_LIBRARIES): shown, not written
    )

    rows.append(("gguf row libraries", GGUF_LIBRARIES, values["ROW_LIBRARIES"]["gguf"]))
    rows.append(("ml_dtypes", getattr(current, "ML_DTYPES_BYTES", 0), values["ROW_LIBRARIES"]["ml_dtypes"]))
    rows.append(("per tensor (bytes)", current.PER_TENSOR, values["PER_TENSOR"]))
    print("| constant | current | measured now |\n|---|---:|---:|")
    for name, old, new in rows:
        show = str if name.startswith("per tensor") else mib
        print(f"| {name} | {show(old)} | {show(new)} |")
    if args.write:
        TARGET.write_text(module_text(values, args.repeat), encoding="utf-8")
        print(f"wrote {TARGET.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
