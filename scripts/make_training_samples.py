"""Generate the training-checkpoint samples under sample_checkpoints/training/ (deterministic weights).

    python scripts/make_training_samples.py [--out sample_checkpoints/training] [--only dcp_2ranks ...]

Samples (each a few KB):
  dcp_2ranks/            DCP written by 2 gloo ranks; DTensor parameters sharded Shard(0) (and one Shard(1)),
                         optimizer state, non-tensor entries
  dcp_pp/pp0, pp1/       one DCP per pipeline stage (merged by the workbench into one catalog)
  lightning/ema.ckpt     a real Lightning Trainer checkpoint with Lightning's EMAWeightAveraging callback
  lightning/torch_ema.ckpt  the same model with a torch_ema-style callback (unnamed shadow_params list)
  lightning_fsdp.ckpt/   Lightning FSDP "sharded" layout: DCP of {model, optimizer_0} + meta.pt (plain data)
  atorch_flat/           atorch flat-parameter checkpoint taken from a real FSDP (use_orig_params) run on
                         2 gloo ranks, + atorch_flat_expected.safetensors (full parameters and optimizer state)
  torch/pytorch_model.bin   a plain state_dict with tied weights and a transposed (strided) view
  torch/trainer_state.pt    a checkpoint that names a non-allowlisted class (argparse.Namespace)
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "sample_checkpoints" / "training"
warnings.filterwarnings("ignore")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _fresh(path: Path) -> Path:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
    return path


# ---------------------------------------------------------------------------------------------- DCP, 2 ranks


def _dcp_full_state() -> dict:
    gen = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(10, 6, generator=gen),
        "layers.0.weight": torch.randn(9, 6, generator=gen),  # 9 rows over 2 ranks: uneven shards 5 + 4
        "layers.0.bias": torch.randn(9, generator=gen),
        "head.weight": torch.randn(4, 9, generator=gen),
        "norm.weight": torch.randn(6, generator=gen).to(torch.bfloat16),
    }


def _dcp_worker(rank: int, out: str, port: int) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    full = _dcp_full_state()
    model = {
        "embed.weight": distribute_tensor(full["embed.weight"], mesh, [Shard(0)]),
        "layers.0.weight": distribute_tensor(full["layers.0.weight"], mesh, [Shard(0)]),
        "layers.0.bias": full["layers.0.bias"],
        "head.weight": distribute_tensor(full["head.weight"], mesh, [Shard(1)]),
        "norm.weight": full["norm.weight"],
    }
    exp_avg = {k: distribute_tensor(v.float() * 0.1, mesh, [Shard(0)]) for k, v in full.items() if k.endswith("weight") and v.dim() == 2}
    state = {
        "model": model,
        "optimizer": {
            "state": {k: {"exp_avg": v, "step": torch.tensor(3.0)} for k, v in exp_avg.items()},
            "param_groups": [{"lr": 0.01, "betas": (0.9, 0.95), "params": sorted(exp_avg)}],
        },
        "train_state": {"step": 3, "tokens_seen": 3 * 4096},
    }
    dcp.save(state, checkpoint_id=out)
    dist.barrier()
    dist.destroy_process_group()


def make_dcp_2ranks(out: Path) -> None:
    import torch.multiprocessing as mp

    target = _fresh(out / "dcp_2ranks")
    mp.spawn(_dcp_worker, args=(str(target), _free_port()), nprocs=2)


def make_dcp_pp(out: Path) -> None:
    import torch.distributed.checkpoint as dcp

    target = _fresh(out / "dcp_pp")
    full = _dcp_full_state()
    stages = [
        {"embed.weight": full["embed.weight"], "layers.0.weight": full["layers.0.weight"], "layers.0.bias": full["layers.0.bias"]},
        {"norm.weight": full["norm.weight"], "head.weight": full["head.weight"]},
    ]
    for i, params in enumerate(stages):
        dcp.save({"model": params, "train_state": {"step": 3, "stage": i}}, checkpoint_id=str(target / f"pp{i}"), no_dist=True)


# ---------------------------------------------------------------------------------------------- Lightning


def _lightning_classes():
    import pytorch_lightning as pl
    import torch.nn.functional as F

    class TinyLit(pl.LightningModule):
        def __init__(self, hidden: int = 8, lr: float = 0.05) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.model = nn.Sequential(nn.Linear(4, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, 2))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.model(x), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)

    class ShadowEMA(pl.Callback):
        """torch_ema-style EMA: an unnamed list of shadow parameters, in parameter order."""

        def __init__(self, decay: float = 0.9) -> None:
            self.decay = decay
            self.num_updates = 0
            self.shadow: list[torch.Tensor] = []

        def on_fit_start(self, trainer, pl_module) -> None:
            self.shadow = [p.detach().clone() for p in pl_module.parameters() if p.requires_grad]

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.num_updates += 1
            with torch.no_grad():
                for s, p in zip(self.shadow, [p for p in pl_module.parameters() if p.requires_grad], strict=True):
                    s.mul_(self.decay).add_(p.detach(), alpha=1 - self.decay)

        @property
        def state_key(self) -> str:
            return "ShadowEMA"

        def state_dict(self) -> dict:
            return {"decay": self.decay, "num_updates": self.num_updates, "shadow_params": [s.clone() for s in self.shadow]}

    return pl, TinyLit, ShadowEMA


def _train_lightning(*callbacks):
    pl, TinyLit, _ = _lightning_classes()
    pl.seed_everything(0, verbose=False)
    model = TinyLit()
    gen = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=gen), torch.randn(32, 2, generator=gen))
    trainer = pl.Trainer(
        max_steps=4, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks), deterministic=True,
    )
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8))
    return trainer, model


def _save_at_last_step(path: Path):
    """A callback that saves the checkpoint after the last training step (the EMA callback has updated by then)."""
    import pytorch_lightning as pl

    class SaveAtLastStep(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if trainer.global_step == trainer.max_steps:
                trainer.save_checkpoint(path)

    return SaveAtLastStep()


def make_lightning(out: Path) -> None:
    from pytorch_lightning.callbacks import EMAWeightAveraging

    _, _, ShadowEMA = _lightning_classes()
    target = out / "lightning"
    target.mkdir(parents=True, exist_ok=True)
    # Saved at the last step, as a ModelCheckpoint would: after fit ends the callback copies the average into
    # the live weights, so a save then would hold two equal copies.
    _train_lightning(EMAWeightAveraging(decay=0.9), _save_at_last_step(_fresh(target / "ema.ckpt")))
    trainer, _ = _train_lightning(ShadowEMA(decay=0.9))
    trainer.save_checkpoint(_fresh(target / "torch_ema.ckpt"))


def make_lightning_fsdp(out: Path) -> None:
    """Lightning FSDPStrategy(state_dict_type='sharded') layout, written without GPUs: DCP + meta.pt."""
    import torch.distributed.checkpoint as dcp
    from pytorch_lightning import __version__ as pl_version

    _, _, ShadowEMA = _lightning_classes()
    callback = ShadowEMA(decay=0.9)
    trainer, model = _train_lightning(callback)
    target = _fresh(out / "lightning_fsdp.ckpt")
    state_dict = model.state_dict()
    optimizer = trainer.optimizers[0]
    names = [n for n, p in model.named_parameters()]
    osd = optimizer.state_dict()
    optimizer_0 = {
        "state": {names[i]: dict(s) for i, s in osd["state"].items()},
        "param_groups": [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[i] for i in g["params"]]} for g in osd["param_groups"]],
    }
    dcp.save({"model": state_dict, "optimizer_0": optimizer_0}, checkpoint_id=str(target), no_dist=True)
    shadow = dict(zip(names, callback.shadow, strict=True))
    meta = {
        "epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
        "pytorch-lightning_version": pl_version,
        "loops": {"fit_loop": {"epoch_progress": {"current": {"completed": trainer.current_epoch}}}},
        "callbacks": {"ShadowEMA": {"decay": callback.decay, "num_updates": callback.num_updates, "shadow": shadow}},
        "hyper_parameters": dict(model.hparams),
        "lr_schedulers": [],
    }
    torch.save(meta, target / "meta.pt")


# ---------------------------------------------------------------------------------------------- atorch


class _AtorchNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.block = nn.Linear(6, 7)
        self.norm = nn.LayerNorm(7)
        self.add_module("proj-out", nn.Linear(7, 3))  # a '-' in a name: optimizer keys '<fqn>-<state>' stay parseable
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 3))

    def forward(self, ids):
        return getattr(self, "proj-out")(self.norm(self.block(self.embed(ids)))) * self.scale


def _atorch_worker(rank: int, out: str, port: int) -> None:
    import pickle

    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp._common_utils import clean_tensor_name
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from workbench.formats.atorch import shard_pieces, unit_layout

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = FSDP(_AtorchNet(), use_orig_params=True, device_id=torch.device("cpu"), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    ids = torch.arange(8) % 10
    model(ids).square().mean().backward()
    optimizer.step()
    # An unsharded replica (same init, same batch on both ranks) gives the full optimizer state to compare with.
    torch.manual_seed(0)
    replica = _AtorchNet()
    replica_optimizer = torch.optim.Adam(replica.parameters(), lr=0.01)
    replica(ids).square().mean().backward()
    replica_optimizer.step()

    world = 2
    suffix = f"{rank:05d}-{world:05d}"
    params, metas = {}, {"flat_param_meta": {}, "param_meta": {}}
    for fsdp_name, unit in [(n, m) for n, m in model.named_modules() if isinstance(m, FSDP)]:
        handle = unit._handle
        flat = handle.flat_param
        name = clean_tensor_name(fsdp_name) if fsdp_name else ""
        shard_meta = handle.shard_metadata()
        keys, columns = zip(*shard_meta._asdict().items(), strict=True)
        rows = [dict(zip(keys, row, strict=True)) for row in zip(*columns, strict=True)]
        metas["flat_param_meta"][name] = {
            "numels": flat._numels, "flat_numel": flat.numel(), "numels_with_padding": flat._numels_with_padding,
            "is_padding_mask": flat._is_padding_mask,
        }
        in_shard = [i for i in flat._shard_param_infos if i.in_shard]
        # Cross-check our FSDP layout model against the real FlatParameter of this rank.
        starts, total = unit_layout(list(flat._numels), flat.element_size(), world)
        predicted = shard_pieces(starts, list(flat._numels), total, world, rank)
        actual = [(i, s.offset_in_shard, s.numel_in_shard, s.intra_param_start_idx) for i, s in enumerate(flat._shard_param_infos) if s.in_shard]
        assert predicted == actual, (name, predicted, actual)
        for info, row in zip(in_shard, rows, strict=True):
            fqn = ".".join(p for p in (name, clean_tensor_name(row["param_names"])) if p)
            row.update(pad=flat._shard_numel_padded, rank=rank, striped_fsdp_name=name,
                       param_offsets=(info.offset_in_shard, info.offset_in_shard + info.numel_in_shard), flat_numel=flat.numel())
            metas["param_meta"][fqn] = row
        params[name] = flat.detach().clone()
    save_file(params, f"{out}/flat_param.{suffix}")
    with open(f"{out}/flat_meta.{suffix}", "wb") as fh:
        pickle.dump(metas, fh)
    names = {p: clean_tensor_name(n) for n, p in model.named_parameters()}
    osd = optimizer.state_dict()
    ordered = [p for g in optimizer.param_groups for p in g["params"]]
    optim = {f"{names[ordered[i]]}-{k}": v.detach().clone() for i, s in osd["state"].items() for k, v in s.items()}
    save_file(optim, f"{out}/optim_param.{suffix}")

    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True)):
        full = model.state_dict()
    if rank == 0:
        save_file({clean_tensor_name(k): v for k, v in model.named_buffers()}, f"{out}/buffers")
        with open(f"{out}/ckpt_meta", "wb") as fh:
            pickle.dump({"version": 1, "world_size": world, "wrap_class": {("torch.nn.modules.linear", "Linear")}}, fh)
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[p] for p in g["params"]]} for g in optimizer.param_groups]
        for g in groups:
            g["params_names"] = dict(enumerate(g["params"]))
        with open(f"{out}/optim_meta", "wb") as fh:
            pickle.dump(groups, fh)
        expected = {k: v.detach().clone().contiguous() for k, v in full.items()}
        for name, param in replica.named_parameters():
            assert torch.allclose(param, full[name], rtol=1e-6, atol=1e-7), name
            for k, v in replica_optimizer.state[param].items():
                expected[f"optimizer.state.{name}.{k}"] = v.detach().clone().contiguous()
        save_file(expected, f"{out}_expected.safetensors")
    dist.barrier()
    dist.destroy_process_group()


def make_atorch(out: Path) -> None:
    import torch.multiprocessing as mp

    target = _fresh(out / "atorch_flat")
    target.mkdir(parents=True)
    _fresh(out / "atorch_flat_expected.safetensors")
    mp.spawn(_atorch_worker, args=(str(target), _free_port()), nprocs=2)


# ---------------------------------------------------------------------------------------------- torch.save files


def make_torch_files(out: Path) -> None:
    target = out / "torch"
    target.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    embed = nn.Embedding(12, 4)
    head = nn.Linear(4, 12, bias=False)
    head.weight = embed.weight  # tied: one storage, two names
    state = {"embed.weight": embed.weight.detach(), "lm_head.weight": head.weight.detach()}
    proj = torch.randn(4, 6)
    state["proj.weight"] = proj
    state["proj_t.weight"] = proj.t()  # a strided view of the same storage
    state["norm.weight"] = torch.ones(4, dtype=torch.bfloat16)
    torch.save(state, _fresh(target / "pytorch_model.bin"))
    trainer_state = {
        "model": {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)},
        "args": argparse.Namespace(lr=0.1, steps=10),
        "step": 10,
    }
    torch.save(trainer_state, _fresh(target / "trainer_state.pt"))


MAKERS = {
    "dcp_2ranks": make_dcp_2ranks,
    "dcp_pp": make_dcp_pp,
    "lightning": make_lightning,
    "lightning_fsdp": make_lightning_fsdp,
    "atorch": make_atorch,
    "torch": make_torch_files,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--only", nargs="*", choices=sorted(MAKERS), help="make only these samples")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    for name in args.only or MAKERS:
        print(f"making {name} ...", flush=True)
        MAKERS[name](args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
