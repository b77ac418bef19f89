"""llama.cpp's converter outputs the GGUF tests compare with, committed as digests and small files (tests/fixtures/llama_cpp/).

The converter is llama.cpp's `convert_hf_to_gguf.py` from the llama-cpp-python sdist (tests/gguf_support/reference.py
fetches it). Its outputs are keyed by a digest of the input folder, the outtype and the extra arguments; MANIFEST.json
maps each key to the SHA-256 and size of what the converter wrote, and outputs up to 600 kB are stored as files
(`<key>/model.gguf`). The tests answer from there (reference.py `_run_converter`) and run the converter only for an
input the manifest does not know.

    python scripts/make_gguf_references.py            # rerun every GGUF test with the real converter, recording its
                                                      # outputs in .cache/fixtures/llama_cpp-record/ (`make fixtures`)
    python scripts/make_gguf_references.py --from-cache   # record the converter outputs cached by earlier runs
    python scripts/make_gguf_references.py --commit   # replace tests/fixtures/llama_cpp/ with the record
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from gguf_support import reference  # noqa: E402

RECORD = reference.CACHE / "llama_cpp-record"
OUTTYPES = ("f16", "bf16", "q8_0", "f32", "auto")


def record_from_cache() -> None:
    """Record every converter output cached in the sdist's `references/` folder whose input folder is still cached."""
    import hashlib

    from gguf_support import models

    os.environ["WB_LLAMA_CPP_RECORD"] = str(RECORD)
    recipe = hashlib.sha256(Path(models.__file__).read_bytes()).hexdigest()[:8]
    families = hashlib.sha256(Path(models.__file__).with_name("families.py").read_bytes() +
                              Path(models.__file__).read_bytes()).hexdigest()[:8]  # gguf_support/families.py's models
    gpt2 = hashlib.sha256(Path(models.__file__).with_name("gpt2.py").read_bytes() +
                          Path(models.__file__).read_bytes()).hexdigest()[:8]  # gguf_support/gpt2.py's model
    for path in sorted((reference.ROOT / "references").iterdir()):
        if path.name.startswith(".") or path.name.endswith((".tmp", ".building")):
            continue
        stem = path.name[: -len(".gguf")] if path.suffix == ".gguf" else path.name
        extra: tuple[str, ...] = ()
        if "-split-" in stem:
            stem, size = stem.rsplit("-split-", 1)
            extra = ("--split-max-size", size)
        folder_name, outtype = stem.rsplit("-", 1)
        folder = reference.CACHE / "gguf-models" / folder_name
        if f"-{models.SEED}-" in folder_name and not any(f"-{models.SEED}-{r}" in folder_name for r in (recipe, families, gpt2)):
            continue  # a model of another version of gguf_support/models.py
        if outtype not in OUTTYPES or not (folder / "model.safetensors").is_file():
            print(f"skip {path.name}: no cached input folder", file=sys.stderr)
            continue
        written = sorted(path.glob("model-*.gguf")) if path.is_dir() else [path]
        reference._record(folder, outtype, written, extra)
        print(f"recorded {path.name}")


def rebuild() -> int:
    """Every GGUF test with the real converter (fresh references), recording what it writes."""
    shutil.rmtree(reference.ROOT / "references", ignore_errors=True)
    shutil.rmtree(RECORD, ignore_errors=True)
    env = {**os.environ, "WB_LLAMA_CPP": "real", "WB_LLAMA_CPP_RECORD": str(RECORD),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    tests = sorted(str(p) for p in (REPO / "tests").rglob("test_*gguf*.py"))  # wherever the test tree puts them
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout=900", *tests], env=env).returncode


def recorded() -> dict[str, dict]:
    """key -> entry of every recorded output."""
    return {p.name: json.loads((p / "entry.json").read_text()) for p in sorted(RECORD.iterdir()) if (p / "entry.json").is_file()}


def _tools() -> dict[str, str]:
    from importlib.metadata import version

    return {"llama-cpp-python (convert_hf_to_gguf.py)": reference.VERSION, "gguf": version("gguf"),
            "transformers": version("transformers"), "torch": version("torch")}


def commit() -> None:
    """tests/fixtures/llama_cpp/ from the record: MANIFEST.json and the stored files."""
    entries = recorded()
    for key, entry in entries.items():  # "auto": the concrete outtype whose file is the same, for the workbench to write
        if key.endswith("-auto"):
            same = [k for k, e in entries.items() if k.startswith(key[: -len("auto")]) and k != key and e["files"] == entry["files"]]
            entry["workbench_dtype"] = same[0].rsplit("-", 1)[1] if same else None
    shutil.rmtree(reference.COMMITTED, ignore_errors=True)
    reference.COMMITTED.mkdir(parents=True)
    for key, entry in entries.items():
        if entry["stored"]:
            shutil.copytree(RECORD / key, reference.COMMITTED / key, ignore=shutil.ignore_patterns("entry.json"))
    manifest = {"made_by": "scripts/make_gguf_references.py", "tools": _tools(), "outputs": entries}
    (reference.COMMITTED / "MANIFEST.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    print(reference.COMMITTED)


def main() -> int:
    if "--from-cache" in sys.argv:
        record_from_cache()
        return 0
    if "--commit" in sys.argv:
        commit()
        return 0
    return rebuild()


if __name__ == "__main__":
    raise SystemExit(main())
