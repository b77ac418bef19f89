"""Memory and time of loading a checkpoint into a module and saving it back, workbench vs the usual ways.

Each case runs in a fresh process (clean RSS); the parent prints one table. Columns:
  model      bytes of the module's state (per rank for the 2-rank FSDP2 cases)
  held       tensor bytes the workbench held beside the module's own storage (its ledger; '-' for others)
  bound      the largest group's bytes (inputs + outputs): what `held` may not exceed
  transient  RSS high-water mark above the RSS the process ends with (load) / starts with (save):
             memory used only during the operation, i.e. what a bounded-memory load or save avoids
  seconds    wall time of the operation alone

Run: `.venv/bin/python benchmarks/bench_model_io.py [--hidden 768 --layers 8] [--no-dist]`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()


def config(hidden: int, layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 8 // 3, num_hidden_layers=layers,
                       num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128, vocab_size=8000,
                       tie_word_embeddings=False)


def make_checkpoint(folder: Path, hidden: int, layers: int) -> None:
    """A random Llama-like checkpoint written by transformers (HF-sharded, F32)."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(config(hidden, layers)).save_pretrained(folder, max_shard_size="100MB")


def _rss() -> tuple[int, int]:
    from workbench.engine.memory import rss_bytes, rss_peak_bytes

    return rss_bytes(), rss_peak_bytes()


def _state_bytes(model) -> int:
    from workbench.model_io.local_part import local_tensor

    return sum(local_tensor(t).numel() * local_tensor(t).element_size() for t in model.state_dict().values())


def child(kind: str, folder: Path, scratch: Path) -> dict:
    """Run one case in this process and return its measurements."""
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    import workbench as wb
    import workbench.model_io  # noqa: F401  (imported before timing)
    from workbench.engine.memory import reset_rss_peak

    cfg = AutoConfig.from_pretrained(folder)
    row: dict = {"held": None, "bound": None}
    if kind.startswith("dist"):
        return dist_child(kind, folder, scratch, cfg)
    if kind in ("load: workbench load_into", "load: load_file + load_state_dict"):
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
        reset_rss_peak()
        started = time.perf_counter()
        if kind.endswith("load_into"):
            report = wb.load_into(model, folder)
            row.update(held=report.peak_tensor_bytes, bound=report.largest_group_bytes)
        else:
            from safetensors.torch import load_file

            model.to_empty(device="cpu")
            state = {}
            for name in sorted(os.listdir(folder)):
                if name.endswith(".safetensors"):
                    state.update(load_file(folder / name))
            model.load_state_dict(state, strict=False)
            del state
        row["seconds"] = time.perf_counter() - started
        now, peak = _rss()
        row.update(model=_state_bytes(model), transient=peak - now)
        return row
    if kind == "load: transformers from_pretrained":
        reset_rss_peak()
        started = time.perf_counter()
        model = LlamaForCausalLM.from_pretrained(folder)
        row["seconds"] = time.perf_counter() - started
        now, peak = _rss()
        row.update(model=_state_bytes(model), transient=peak - now)
        return row
    with torch.device("meta"):  # resident weights (from_pretrained may leave them memory-mapped, paged in by the save)
        model = LlamaForCausalLM(cfg)
    wb.load_into(model, folder)
    before, _ = _rss()
    reset_rss_peak()
    started = time.perf_counter()
    if kind == "save: workbench save_from":
        report = wb.save_from(model, scratch / "saved", shard_size="100MB")
        row.update(held=report.peak_tensor_bytes, bound=max(t.nbytes for t in model.state_dict().values()))
    else:
        model.save_pretrained(scratch / "saved", max_shard_size="100MB")
    row["seconds"] = time.perf_counter() - started
    _, peak = _rss()
    row.update(model=_state_bytes(model), transient=peak - before)
    return row


def dist_child(kind: str, folder: Path, scratch: Path, cfg) -> dict:
    """One rank of the 2-rank FSDP2 cases: load_into the sharded model, then save_from it."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    import workbench as wb
    from workbench.engine.memory import reset_rss_peak

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    reset_rss_peak()
    started = time.perf_counter()
    loaded = wb.load_into(model, folder)
    load_seconds = time.perf_counter() - started
    now, peak = _rss()
    rows = {"load": {"model": _state_bytes(model), "held": loaded.peak_tensor_bytes, "bound": loaded.largest_group_bytes,
                     "transient": peak - now, "seconds": load_seconds}}
    before, _ = _rss()
    reset_rss_peak()
    started = time.perf_counter()
    saved = wb.save_from(model, scratch / "dist-saved", shard_size="100MB")
    seconds = time.perf_counter() - started
    _, peak = _rss()
    mine = saved.ranks[dist.get_rank()]
    rows["save"] = {"model": _state_bytes(model), "held": mine.peak_tensor_bytes, "bound": mine.predicted_peak_bytes,
                    "transient": peak - before, "seconds": seconds}
    dist.destroy_process_group()
    return rows


CASES = [
    "load: workbench load_into", "load: load_file + load_state_dict", "load: transformers from_pretrained",
    "save: workbench save_from", "save: transformers save_pretrained",
]


def run_case(kind: str, folder: Path) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        done = subprocess.run([sys.executable, str(HERE), "--child", kind, str(folder), scratch],
                              capture_output=True, text=True, check=True)
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def run_dist(folder: Path) -> list[tuple[str, dict]]:
    with tempfile.TemporaryDirectory() as scratch:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                               str(HERE), "--child", "dist", str(folder), scratch],
                              capture_output=True, text=True, check=True, env=env)
    rows = [json.loads(line[len("RESULT "):]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    out = []
    for rank, result in sorted((r["rank"], r) for r in rows):
        out.append((f"load: load_into, FSDP2 rank {rank}/2", result["load"]))
        out.append((f"save: save_from, FSDP2 rank {rank}/2", result["save"]))
    return out


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:8.1f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--no-dist", action="store_true", help="skip the 2-rank FSDP2 cases")
    parser.add_argument("--child", nargs=3, metavar=("KIND", "FOLDER", "SCRATCH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, folder, scratch = args.child
        result = child(kind, Path(folder), Path(scratch))
        if kind == "dist":
            result = {"rank": int(os.environ.get("RANK", "0")), **result}
        os.write(1, ("RESULT " + json.dumps(result) + "\n").encode())
        if kind == "dist":
            # torch's DTensor caches keep the gloo group and its worker threads alive after destroy_process_group;
            # a worker still releasing a finished collective while the interpreter shuts down aborts the process
            # ("terminate called without an active exception", seen under CPU load). Leave without that shutdown.
            os._exit(0)
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "ckpt"
        make_checkpoint(folder, args.hidden, args.layers)
        for shard in folder.glob("*.safetensors"):  # every case starts with the checkpoint in the page cache
            shard.read_bytes()
        rows = [(kind, run_case(kind, folder)) for kind in CASES]
        if not args.no_dist:
            rows += run_dist(folder)
    print(f"checkpoint: Llama-like, hidden {args.hidden}, {args.layers} layers, F32")
    print(f"{'case':40} {'model':>12} {'held':>12} {'bound':>12} {'transient':>12} {'seconds':>8}")
    for kind, r in rows:
        print(f"{kind:40} {mib(r['model']):>12} {mib(r['held']):>12} {mib(r['bound']):>12} {mib(r['transient']):>12} "
              f"{r['seconds']:8.2f}")


if __name__ == "__main__":
    main()
