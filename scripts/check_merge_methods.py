"""Dev check: every merge method against `mergekit-yaml` (mergekit 0.1.5, its own venv) on tiny Llama models.

    python scripts/check_merge_methods.py [--dtype bfloat16 float32] [--method ties slerp ...] [--keep DIR]

Builds a random tiny Llama (hidden 64, 2 layers, transformers `save_pretrained`) as the base and three fine-tunes
of it (base + small noise), in each dtype; runs mergekit-yaml (`--lazy-unpickle --no-copy-tokenizer
--random-seed 0`) and the workbench on the same config; compares every tensor bit for bit. The random methods
(DARE, DELLA) draw other masks than mergekit (see workbench/mapper/merge/task_arithmetic.py): for them the
kept fraction and the mean absolute difference are printed instead. Needs the mergekit venv
(`make fixtures` builds it; path below). Not part of `make test` (mergekit is not installed there); the
committed reference digests live in tests/fixtures/mergekit/.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".cache" / "fixtures" / "venv-mergekit-0.1.5-torch-2.13.0"
RANDOM = {"dare_linear", "dare_ties", "della", "della_linear"}

# method -> (models with their parameters, base_model, global parameters)
CASES: dict[str, tuple[list[tuple[str, dict]], str | None, dict]] = {
    "linear": ([("a", {"weight": 0.5}), ("b", {"weight": 0.3}), ("c", {"weight": [0.2, 0.6]})], None, {}),
    "passthrough": ([("a", {"scale": 0.5})], None, {}),
    "nearswap": ([("base", {}), ("a", {})], "base", {"t": 0.002}),
    "slerp": ([("base", {}), ("a", {})], "base",
              {"t": [{"filter": "self_attn", "value": [0, 0.5, 1]}, {"filter": "mlp", "value": [1, 0.5, 0]}, {"value": 0.3}]}),
    "nuslerp": ([("a", {"weight": 0.4}), ("b", {"weight": 0.6})], "base", {}),
    "multislerp": ([("a", {"weight": 0.5}), ("b", {"weight": 0.3}), ("c", {"weight": 0.2})], "base", {}),
    "karcher": ([("a", {}), ("b", {}), ("c", {})], None, {}),
    "task_arithmetic": ([("a", {"weight": 0.7}), ("b", {"weight": [0.2, 0.9]})], "base", {"lambda": 0.8}),
    "ties": ([("a", {"weight": 1.0, "density": 0.5}), ("b", {"weight": 0.5, "density": 0.7}),
              ("c", {"weight": 0.3, "density": 0.3})], "base", {}),
    "dare_linear": ([("a", {"weight": 0.6, "density": 0.5}), ("b", {"weight": 0.4, "density": 0.5})], "base", {}),
    "dare_ties": ([("a", {"weight": 0.6, "density": 0.5}), ("b", {"weight": 0.4, "density": 0.5})], "base", {}),
    "breadcrumbs": ([("a", {"weight": 0.6, "density": 0.8, "gamma": 0.05}), ("b", {"weight": 0.4, "density": 0.7})], "base", {}),
    "breadcrumbs_ties": ([("a", {"weight": 0.6, "density": 0.8}), ("b", {"weight": 0.4, "density": 0.7, "gamma": 0.02})],
                         "base", {}),
    "della": ([("a", {"weight": 0.6, "density": 0.5, "epsilon": 0.1}), ("b", {"weight": 0.4, "density": 0.5})], "base", {}),
    "della_linear": ([("a", {"weight": 0.6, "density": 0.5}), ("b", {"weight": 0.4, "density": 0.6})], "base", {}),
    "sce": ([("a", {}), ("b", {}), ("c", {})], "base", {"select_topk": 0.5}),
    "model_stock": ([("a", {}), ("b", {}), ("c", {})], "base", {}),
}

BUILD = r"""
import sys, torch, transformers
out, dtype = sys.argv[1], getattr(torch, sys.argv[2])
config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=96, tie_word_embeddings=False)
torch.manual_seed(0)
base = transformers.LlamaForCausalLM(config)
with torch.no_grad():
    for p in base.parameters():
        p.normal_(0, 0.05) if p.dim() > 1 else p.uniform_(0.8, 1.2)
base.to(dtype).save_pretrained(f"{out}/base")
for k, name in enumerate("abc"):
    torch.manual_seed(k + 1)
    model = transformers.LlamaForCausalLM(config)
    model.load_state_dict(base.state_dict())
    with torch.no_grad():
        for p, q in zip(model.parameters(), base.parameters()):
            p.add_(torch.randn_like(p) * 0.01)
            if k == 2:  # some entries equal to the base: zero task-vector entries (sign ties, sparsification ties)
                p.view(-1)[::7] = q.view(-1)[::7]
    model.to(dtype).save_pretrained(f"{out}/{name}")
"""


def build(folder: Path, dtype: str) -> None:
    """Base and three fine-tunes, saved by transformers in `dtype`."""
    subprocess.run([str(VENV / "bin" / "python"), "-c", BUILD, str(folder), dtype], check=True)


def config(method: str, folder: Path, dtype: str) -> dict:
    models, base, parameters = CASES[method]
    out: dict = {"merge_method": method, "models": [{"model": str(folder / m), **({"parameters": p} if p else {})} for m, p in models]}
    if base:
        out["base_model"] = str(folder / base)
    if parameters:
        out["parameters"] = parameters
    return out


def run_mergekit(method: str, folder: Path, dtype: str, out: Path) -> float:
    import time

    path = out.parent / f"{out.name}.yml"
    path.write_text(json.dumps(config(method, folder, dtype)))
    start = time.perf_counter()
    subprocess.run([str(VENV / "bin" / "mergekit-yaml"), str(path), str(out), "--lazy-unpickle", "--no-copy-tokenizer",
                    "--random-seed", "0", "--quiet"], check=True, capture_output=True)
    return time.perf_counter() - start


def run_workbench(method: str, folder: Path, out: Path) -> None:
    import workbench as wb
    from workbench import mapper as M

    models, base, parameters = CASES[method]
    names = [m for m, _ in models]
    sources = dict.fromkeys([*names, *([base] if base and base not in names else [])])
    mapper = M.presets.merge(method, names, base_model=base, parameters=parameters,
                             model_parameters={m: p for m, p in models if p}, seed=0)
    wb.convert({name: folder / name for name in sources}, out, mapper, quiet=True)


def load(folder: Path) -> dict:
    from safetensors.torch import load_file

    tensors: dict = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def compare(method: str, ours: dict, theirs: dict) -> str:
    import torch

    if set(ours) != set(theirs):
        return f"names differ: only ours {sorted(set(ours) - set(theirs))[:3]}, only mergekit {sorted(set(theirs) - set(ours))[:3]}"
    bad = [n for n in theirs if ours[n].dtype != theirs[n].dtype or not torch.equal(ours[n], theirs[n])]
    if method in RANDOM:
        diff = max(float((ours[n].float() - theirs[n].float()).abs().mean()) for n in theirs)
        return f"random: {len(bad)}/{len(theirs)} differ (expected), max mean |diff| {diff:.2e}"
    if bad:
        n = bad[0]
        d = (ours[n].float() - theirs[n].float()).abs().max()
        return f"FAIL {len(bad)}/{len(theirs)} tensors differ, e.g. {n} ({ours[n].dtype} vs {theirs[n].dtype}, max |diff| {d:.3e})"
    return f"bit-identical ({len(theirs)} tensors)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--method", nargs="+", default=list(CASES))
    parser.add_argument("--keep", type=Path, default=None, help="work in this folder and keep it")
    args = parser.parse_args()
    if not (VENV / "bin" / "mergekit-yaml").exists():
        print(f"mergekit venv missing: {VENV}", file=sys.stderr)
        return 2
    work = args.keep or Path(tempfile.mkdtemp(prefix="merge-check-"))
    failures = 0
    try:
        for dtype in args.dtype:
            folder = work / dtype
            if not (folder / "c").exists():
                build(folder, dtype)
            for method in args.method:
                theirs_dir, ours_dir = work / f"{method}-{dtype}-mergekit", work / f"{method}-{dtype}-workbench"
                for d in (theirs_dir, ours_dir):
                    shutil.rmtree(d, ignore_errors=True)
                try:
                    run_mergekit(method, folder, dtype, theirs_dir)
                except subprocess.CalledProcessError as exc:
                    print(f"{method:17} {dtype:9} mergekit failed: {exc.stderr.decode()[-300:]}")
                    failures += 1
                    continue
                try:
                    run_workbench(method, folder, ours_dir)
                except Exception as exc:  # a dev script: report and go on
                    print(f"{method:17} {dtype:9} workbench failed: {type(exc).__name__}: {exc}")
                    failures += 1
                    continue
                verdict = compare(method, load(ours_dir), load(theirs_dir))
                failures += verdict.startswith("FAIL") or verdict.startswith("names")
                print(f"{method:17} {dtype:9} {verdict}", flush=True)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
