"""Load an HF checkpoint into an FSDP2-sharded model, train a step, save it back as an HF checkpoint.

    torchrun --nproc-per-node 2 examples/train_fsdp2_roundtrip.py sample_checkpoints/tiny-llama /tmp/trained

The model is built on the meta device (no memory for weights), sharded with `fully_shard`, then
`wb.load_into` materialises it, each rank reads only the rows of the weights it owns, and the buffers no
checkpoint holds (rotary frequencies) are recomputed as `from_pretrained` does.
`wb.save_from` gathers one tensor at a time and splits the output files across ranks; the result
opens with `from_pretrained` like any HF checkpoint. Runs on CPU with gloo.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoConfig, AutoModelForCausalLM

import workbench as wb


def build_sharded_model(checkpoint: Path, mesh) -> torch.nn.Module:
    """The checkpoint's architecture on the meta device, each decoder layer and the whole model sharded."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(checkpoint))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train_step(model: torch.nn.Module, vocab: int, seed: int) -> float:
    """One optimizer step on a random batch (each rank its own batch, as data parallelism does)."""
    generator = torch.Generator().manual_seed(seed + dist.get_rank())
    tokens = torch.randint(0, vocab, (2, 16), generator=generator)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def main(checkpoint: Path, out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = build_sharded_model(checkpoint, mesh)

    # a progress bar on rank 0; non-persistent buffers (rotary frequencies) are recomputed, see loaded.recomputed
    loaded = wb.load_into(model, checkpoint)
    if rank == 0:
        print(loaded, flush=True)

    loss = train_step(model, model.config.vocab_size, seed=0)
    saved = wb.save_from(model, out, shard_size="200KB", overwrite=True)
    if rank == 0:
        shutil.copyfile(checkpoint / "config.json", out / "config.json")
        print(f"loss {loss:.4f}", flush=True)
        print(saved, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
    # torch's DTensor caches keep the gloo group and its worker threads alive after destroy_process_group;
    # a worker still releasing a finished collective while the interpreter shuts down aborts the process
    # ("terminate called without an active exception", seen under CPU load). Leave without that shutdown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
