"""llama.cpp's `convert_hf_to_gguf.py`, run (never copied) from the llama-cpp-python source distribution.

The sdist is fetched once with pip into `.cache/fixtures/llama_cpp_python-<version>/` (ignored by git);
`sentencepiece`, which the converter imports for Llama models, goes into a folder beside it (`extra-site`)
rather than into the shared venv. Reference GGUFs are cached there keyed by the tool version and the
fixture's seed and recipe (a digest of models.py), so the suite converts each model once.

Each cached thing is built under an exclusive lock and appears whole (built aside, then renamed), so the
suite and its background pre-build (`prebuild.py`, started by conftest) can ask for the same one: whoever
comes first builds it, the other waits and reads it.

The converter's outputs are committed as digests (tests/fixtures/llama_cpp/MANIFEST.json, keyed by a digest of the
input folder's files, the outtype and the converter's extra arguments), with the small files themselves beside it.
`_run_converter` answers from there when it can: a stored file is copied; otherwise the workbench writes the file
and it counts as llama.cpp's only when its SHA-256 is the one llama.cpp's converter wrote (a difference fails
there, naming both digests). Only an input the manifest does not know runs the converter, or one whose output is
too large to store and of a family the workbench does not write (families.py's Gemma 3 F16: ~10 s, in the pre-build). `make fixtures` runs the
GGUF tests with the real converter (WB_LLAMA_CPP=real) and records what it wrote (WB_LLAMA_CPP_RECORD=<folder>);
tests/system/test_fixtures_committed.py compares that record with the manifest, and scripts/make_gguf_references.py
`--commit` replaces the committed set.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

VERSION = "0.3.36"
CACHE = Path(__file__).resolve().parents[2] / ".cache" / "fixtures"
ROOT = CACHE / f"llama_cpp_python-{VERSION}"
SCRIPT = ROOT / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"
EXTRA = ROOT / "extra-site"
COMMITTED = Path(__file__).resolve().parents[1] / "fixtures" / "llama_cpp"
STORE_MAX = 600_000  # outputs up to this size are committed as files; larger ones as their digest only


# Every (family, outtype, tokenizer) compared with the converter: the tests' parameters and the pre-build's list. One
# case per distinct path: each output type once on Llama (f16, bf16, q8_0, f32), each family's preset once, each
# tokenizer route once; FP8 de-quantisation once per family (deepseek_v3's bf16 case is its FP8 copy's: the same
# MLA split, cast to bf16); Llama 3.1 / 3.2's generated rope_freqs.weight (always F32) next to a quantised type
# (llama31 q8_0, llama32 q8_0) and a float one (llama32 f16: tied embeddings as well).
CASES = [
    ("llama", "f16", None), ("llama", "bf16", None), ("llama", "q8_0", None), ("llama", "f32", None), ("mistral", "q8_0", None),
    ("qwen2", "q8_0", None), ("qwen3", "bf16", None), ("llama", "f16", "spm"), ("llama", "q8_0", "gpt2"),
    ("mixtral", "q8_0", None), ("qwen2_moe", "q8_0", None), ("qwen3_moe", "q8_0", None), ("olmoe", "q8_0", None),
    ("llama", "f16", "llama3"), ("deepseek_v3", "q8_0", None),
    # FP8 block-quantised copies (gguf_support/fp8.py): the converter de-quantises them first
    ("deepseek_v3-fp8", "q8_0", None), ("deepseek_v3-fp8", "bf16", None), ("llama-fp8", "q8_0", None), ("qwen3-fp8", "q8_0", None),
    ("llama31", "q8_0", None), ("llama32", "q8_0", None), ("llama32", "f16", None)]


@contextmanager
def building(target: Path) -> Iterator[None]:
    """Hold the build lock of one cached `target` (a file or folder) across processes."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def cached_folder(folder: Path, make: Callable[[Path], None]) -> Path:
    """`folder`, made once across processes: `make(aside)` builds it beside, then it is renamed into place, so a
    folder holding `model.safetensors` is always complete."""
    if (folder / "model.safetensors").is_file():
        return folder
    with building(folder):
        if not (folder / "model.safetensors").is_file():
            aside = folder.with_name(f"{folder.name}.building")
            shutil.rmtree(aside, ignore_errors=True)
            make(aside)
            shutil.rmtree(folder, ignore_errors=True)
            os.replace(aside, folder)
    return folder


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "-q", *args], check=True, capture_output=True, timeout=600)


def converter() -> Path:
    """Path of convert_hf_to_gguf.py, fetching the sdist once; skips the test when it cannot be fetched."""
    if SCRIPT.is_file() and (EXTRA / "sentencepiece").is_dir():
        return SCRIPT
    with building(ROOT):
        return _fetch_converter()


def _fetch_converter() -> Path:
    if SCRIPT.is_file() and (EXTRA / "sentencepiece").is_dir():
        return SCRIPT
    CACHE.mkdir(parents=True, exist_ok=True)
    try:
        if not SCRIPT.is_file():
            _pip("download", "--no-binary", "llama-cpp-python", "--no-deps", f"llama-cpp-python=={VERSION}", "-d", str(CACHE))
            with tarfile.open(CACHE / f"llama_cpp_python-{VERSION}.tar.gz") as tar:
                tar.extractall(CACHE, filter="data")
        if not (EXTRA / "sentencepiece").is_dir():
            _pip("install", "--target", str(EXTRA), "sentencepiece")
    except (subprocess.SubprocessError, OSError, tarfile.TarError) as exc:
        pytest.skip(f"llama-cpp-python {VERSION} source distribution (llama.cpp's converter) cannot be fetched: {exc}")
    return SCRIPT


DEFAULT_TOKENIZERS = {"llama": "fallback", "llama31": "fallback", "llama32": "fallback", "mistral": "fallback", "mixtral": "fallback", "qwen2": "qwen2", "qwen3": "qwen2", "qwen2_moe": "qwen2", "qwen3_moe": "qwen2", "olmoe": "gpt2", "deepseek_v3": "gpt2"}


def _train_sentencepiece(prefix: Path) -> None:
    """Train a tiny SentencePiece BPE on llama.cpp's README with the sentencepiece installed beside the sdist."""
    from gguf_support.models import TRAIN_SENTENCEPIECE

    text = SCRIPT.parent / "README.md"
    # From the folder, with a relative prefix: the model records its prefix, and a path would make the file (and the
    # committed references' key of this input) differ from checkout to checkout.
    subprocess.run([sys.executable, "-c", TRAIN_SENTENCEPIECE, str(text), prefix.name], check=True, capture_output=True,
                   timeout=300, env={**os.environ, "PYTHONPATH": str(EXTRA)}, cwd=prefix.parent)


def model_folder(family: str, tokenizer: str | None = None) -> Path:
    """A cached tiny random `family` HF model with a tokenizer: "fallback" (byte-fallback BPE), "spm" (SentencePiece)
    "gpt2" (GPT-2's byte-level BPE), "qwen2" (Qwen2's) or "llama3" (Llama 3's); the family's usual kind by default. Built once per seed.
    `family` "<family>-fp8": that model's FP8 block-quantised copy (gguf_support/fp8.py)."""
    from gguf_support.models import build

    base, _, variant = family.partition("-")
    if variant == "fp8":
        return _fp8_folder(base, tokenizer)
    kind = tokenizer or DEFAULT_TOKENIZERS[family]
    folder = CACHE / "gguf-models" / folder_name(family, tokenizer)
    if (folder / "model.safetensors").is_file():
        return folder
    if kind != "fallback":
        converter()  # the sdist holds the GPT-2 vocabulary and the sentencepiece trainer
    vocab = SCRIPT.parent / "models" / f"ggml-vocab-{ {'qwen2': 'qwen2', 'llama3': 'llama-bpe'}.get(kind, 'gpt-2')}.gguf"
    return cached_folder(folder, lambda aside: build(aside, family, tokenizer=kind, vocab_gguf=vocab, train=_train_sentencepiece))


def folder_name(family: str, tokenizer: str | None = None) -> str:
    """The cached folder's name of `model_folder(family, tokenizer)` (not an FP8 copy), without building it: a changed
    recipe (models.py) is a new model, whose llama.cpp references the committed manifest must know anew."""
    from gguf_support.models import SEED

    kind = tokenizer or DEFAULT_TOKENIZERS[family]
    recipe = hashlib.sha256((Path(__file__).parent / "models.py").read_bytes()).hexdigest()[:8]
    return f"{family}-{SEED}-{recipe}" if kind == "fallback" else f"{family}-{kind}-{SEED}-{recipe}"


def _fp8_folder(family: str, tokenizer: str | None) -> Path:
    """The cached FP8 copy of `model_folder(family, tokenizer)`, keyed by its recipe (a digest of fp8.py)."""
    from gguf_support.fp8 import BLOCKS, build_fp8

    base = model_folder(family, tokenizer)
    recipe = hashlib.sha256((Path(__file__).parent / "fp8.py").read_bytes()).hexdigest()[:8]
    folder = base.with_name(f"{base.name}-fp8-{recipe}")
    return cached_folder(folder, lambda aside: build_fp8(base, aside, BLOCKS[family]))
    return folder


def reference_gguf(family: str, outtype: str, tokenizer: str | None = None) -> Path:
    """What llama.cpp's converter writes for `model_folder(family, tokenizer)` with `--outtype outtype` (cached)."""
    script = None  # the converter is fetched only when the committed references do not answer
    folder = model_folder(family, tokenizer)
    out = ROOT / "references" / f"{folder.name}-{outtype}.gguf"
    if out.is_file():
        return out
    with building(out):
        if not out.is_file():
            _run_converter(script, folder, outtype, out)
    return out


def reference_split(family: str, outtype: str, split_max_size: str) -> list[Path]:
    """The split files llama.cpp's converter writes for `model_folder(family)` with `--split-max-size split_max_size`
    (e.g. "60K"), in order (cached)."""
    script = None
    folder = model_folder(family)
    out = ROOT / "references" / f"{folder.name}-{outtype}-split-{split_max_size}"
    if not out.is_dir():
        with building(out):
            if not out.is_dir():
                aside = out.with_name(out.name + ".building")
                shutil.rmtree(aside, ignore_errors=True)
                aside.mkdir(parents=True)
                _run_converter(script, folder, outtype, aside / "model.gguf", ("--split-max-size", split_max_size), replace=False)
                os.replace(aside, out)
    return sorted(out.glob("model-*.gguf"))


def input_key(folder: Path, outtype: str, extra: tuple[str, ...] = ()) -> str:
    """The manifest's key of one conversion: a digest of the folder's name (the converter names the model after it:
    general.name, size label), of every file under it (names and bytes), the outtype and the converter's extra
    arguments."""
    digest = hashlib.sha256(folder.name.encode() + b"\0")
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(path.relative_to(folder).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return "-".join([digest.hexdigest()[:24], outtype, *extra])


def committed_manifest() -> dict:
    """tests/fixtures/llama_cpp/MANIFEST.json ({} when absent)."""
    path = COMMITTED / "MANIFEST.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _from_committed(folder: Path, outtype: str, out: Path, extra: tuple[str, ...], replace: bool) -> bool:
    """Write what llama.cpp's converter wrote for this input from the committed references; False when they do not
    know the input (or the real converter is asked for)."""
    if os.environ.get("WB_LLAMA_CPP") == "real":
        return False
    key = input_key(folder, outtype, extra)
    entry = committed_manifest().get("outputs", {}).get(key)
    if entry is None:
        return False
    if not entry["stored"] and not _workbench_writes(folder):
        return False  # a family only llama.cpp writes (families.py's Gemma 3), too large to commit: the converter runs
    target = Path(str(out) + ".tmp") if replace else out
    if entry["stored"]:
        for name in entry["files"]:
            shutil.copyfile(COMMITTED / key / name, target.parent / name if len(entry["files"]) > 1 else target)
    else:
        import workbench as wb

        assert len(entry["files"]) == 1 and not extra, key
        with_workbench = target.parent / f".{target.name}.workbench"
        shutil.rmtree(with_workbench, ignore_errors=True)
        wb.convert(folder, with_workbench, to="gguf", dtype=entry.get("workbench_dtype") or outtype, quiet=True)
        (name, want), = entry["files"].items()
        got = _sha256(with_workbench / "model.gguf")
        if got != want["sha256"]:
            shutil.rmtree(with_workbench, ignore_errors=True)
            raise AssertionError(f"The workbench's GGUF of {folder.name} (--outtype {outtype}) is not llama.cpp's: SHA-256 {got}, "
                                 f"the converter wrote {want['sha256']}. Run the GGUF tests with WB_LLAMA_CPP=real to compare "
                                 "key by key and tensor by tensor.")
        os.replace(with_workbench / "model.gguf", target)
        shutil.rmtree(with_workbench, ignore_errors=True)
    if replace:
        os.replace(target, out)
    return True


def _workbench_writes(folder: Path) -> bool:
    """Whether the workbench writes GGUF for the model in `folder` (its config.json's model_type)."""
    from workbench.mapper.presets.gguf_preset import ARCHITECTURES

    return json.loads((folder / "config.json").read_text()).get("model_type") in ARCHITECTURES


def _record(folder: Path, outtype: str, written: list[Path], extra: tuple[str, ...]) -> None:
    """With WB_LLAMA_CPP_RECORD=<dir> (`make fixtures`): note what the real converter wrote for this input."""
    where = os.environ.get("WB_LLAMA_CPP_RECORD")
    if not where:
        return
    key = input_key(folder, outtype, extra)
    files = {p.name if len(written) > 1 else "model.gguf": {"sha256": _sha256(p), "size": p.stat().st_size} for p in written}
    stored = sum(f["size"] for f in files.values()) <= STORE_MAX
    record = Path(where) / key
    aside = record.with_name(record.name + f".{os.getpid()}")
    shutil.rmtree(aside, ignore_errors=True)
    aside.mkdir(parents=True)
    (aside / "entry.json").write_text(json.dumps({"input": folder.name, "files": files, "stored": stored}, sort_keys=True))
    if stored:
        for p in written:
            shutil.copyfile(p, aside / (p.name if len(written) > 1 else "model.gguf"))
    shutil.rmtree(record, ignore_errors=True)
    os.replace(aside, record)


def _run_converter(script: Path | None, folder: Path, outtype: str, out: Path, extra: tuple[str, ...] = (),
                   replace: bool = True) -> None:
    """llama.cpp's converter on `folder` (answered from the committed references when they know it)."""
    if _from_committed(folder, outtype, out, extra, replace):
        return
    script = script or converter()
    env = {**os.environ, "PYTHONPATH": str(EXTRA)}
    target = str(out) + ".tmp" if replace else str(out)
    done = subprocess.run([sys.executable, str(script), str(folder), "--outtype", outtype, "--outfile", target, *extra],
                          env=env, capture_output=True, text=True, timeout=300)
    if done.returncode:
        raise AssertionError(f"convert_hf_to_gguf.py failed:\n{done.stderr[-3000:]}")
    if replace:
        os.replace(target, out)
    _record(folder, outtype, [out] if replace or not extra else sorted(out.parent.glob("model-*.gguf")), extra)
