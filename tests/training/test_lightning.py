"""The Lightning view: tables, EMA matching and prefix stripping, checked against Lightning's own loading."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import SAMPLES
from workbench.dtypes import to_torch
from workbench.errors import CheckpointError, MapperError
from workbench.formats import open_catalog
from workbench.training.lightning import (
    align_by_order,
    ema_weights,
    lightning_tables,
    open_lightning,
    strip_prefixes,
)

TRAINING = SAMPLES / "training"
EMA_CKPT = TRAINING / "lightning" / "ema.ckpt"
TORCH_EMA_CKPT = TRAINING / "lightning" / "torch_ema.ckpt"
FSDP_FOLDER = TRAINING / "lightning_fsdp.ckpt"
PARAMS = ["model.0.weight", "model.0.bias", "model.1.weight", "model.1.bias", "model.3.weight", "model.3.bias"]
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def load(catalog, name: str) -> torch.Tensor:
    info = catalog[name]
    return torch.frombuffer(bytearray(catalog.read_bytes(name)), dtype=to_torch(info.dtype)).reshape(info.shape)


def lightning_load(path):
    from lightning_fabric.utilities.cloud_io import _load

    return _load(path, map_location="cpu", weights_only=True)


def test_weight_averaging_checkpoint_tables_match_lightning_load():
    ckpt = lightning_load(EMA_CKPT)
    info = open_lightning(EMA_CKPT)
    tables = info.tables()
    # Lightning's WeightAveraging keeps the live weights in current_model_state and the average in state_dict.
    weights = tables["weights"].set_index("weight")
    assert list(weights.index) == list(ckpt["current_model_state"])
    for name, src in weights.source.items():
        assert torch.equal(load(info.catalog, src), ckpt["current_model_state"][name]), name
    ema = ema_weights(EMA_CKPT)
    assert set(ema) == set(ckpt["state_dict"])
    for name, src in ema.items():
        value = load(info.catalog, src)
        assert torch.equal(value, ckpt["state_dict"][name]), name
        assert not torch.equal(value, ckpt["current_model_state"][name]), name  # saved mid-run: the average lags
    assert set(tables["ema"].matched_by) == {"name"}
    assert tables["progress"] == {"epoch": ckpt["epoch"], "global_step": ckpt["global_step"], "lightning_version": ckpt["pytorch-lightning_version"]}
    hp = dict(zip(tables["hyper_parameters"].key, tables["hyper_parameters"].value, strict=True))
    assert hp == dict(ckpt["hyper_parameters"])
    optimizer = tables["optimizer"]
    assert len(optimizer) == 3 * len(PARAMS)
    for row in optimizer.itertuples():
        assert torch.equal(load(info.catalog, row.source), ckpt["optimizer_states"][row.optimizer]["state"][row.param_id][row.state])
    assert "loops.fit_loop.epoch_loop.batch_progress.total.completed" in set(tables["other"].key)


def test_torch_ema_shadow_list_is_matched_by_order():
    ckpt = lightning_load(TORCH_EMA_CKPT)
    tables = lightning_tables(TORCH_EMA_CKPT)
    ema = tables["ema"]
    assert list(ema.weight) == PARAMS  # BatchNorm running stats are buffers, not EMA'd parameters
    assert set(ema.matched_by) == {"order"}
    catalog = open_catalog(TORCH_EMA_CKPT)
    shadow = ckpt["callbacks"]["ShadowEMA"]["shadow_params"]
    for i, (name, src) in enumerate(ema_weights(TORCH_EMA_CKPT).items()):
        assert name == PARAMS[i]
        assert torch.equal(load(catalog, src), shadow[i])
    # The optimizer's parameter ids get the same names (one way to fit the shapes).
    optimizer = tables["optimizer"]
    assert dict(zip(optimizer.param_id, optimizer.param, strict=True)) == dict(enumerate(PARAMS))


def test_sharded_fsdp_folder_matches_lightning_distributed_load():
    from lightning_fabric.utilities.load import _load_distributed_checkpoint

    full = _load_distributed_checkpoint(FSDP_FOLDER)
    info = open_lightning(FSDP_FOLDER)
    assert info.sharded
    weights = info.weight_sources()
    assert set(weights) == set(full["model"])
    for name, src in weights.items():
        assert torch.equal(load(info.catalog, src), full["model"][name]), name
    optimizer = info.optimizer()
    assert len(optimizer) == 3 * len(PARAMS)
    for row in optimizer.itertuples():
        assert torch.equal(load(info.catalog, row.source), full["optimizer_0"]["state"][row.param][row.state])
    ema = ema_weights(FSDP_FOLDER)
    assert list(ema) == PARAMS
    for name, src in ema.items():
        assert src.startswith("meta.callbacks.ShadowEMA.shadow.")
        assert torch.equal(load(info.catalog, src), full["callbacks"]["ShadowEMA"]["shadow"][name])
    assert info.progress()["global_step"] == full["global_step"]
    assert dict(zip(info.hyper_parameters().key, info.hyper_parameters().value, strict=True)) == full["hyper_parameters"]


def _lightning_like(tmp_path, state_dict: dict, shadow: list) -> str:
    path = tmp_path / "last.ckpt"
    torch.save({"pytorch-lightning_version": "2.6.6", "epoch": 0, "global_step": 1, "state_dict": state_dict,
                "callbacks": {"EMA": {"shadow_params": shadow}}}, path)
    return path


def test_ambiguous_order_matching_is_refused_then_resolved_by_param_names(tmp_path):
    sd = {"model.a": torch.zeros(4), "model.b": torch.ones(4), "model.c": torch.full((4,), 2.0)}
    path = _lightning_like(tmp_path, sd, [torch.full((4,), 5.0), torch.full((4,), 6.0)])
    with pytest.raises(CheckpointError, match="param_names") as err:
        ema_weights(path)
    assert str(path) in str(err.value)
    assert ema_weights(path, param_names=["model.a", "model.c"]) == {
        "model.a": "callbacks.EMA.shadow_params.0", "model.c": "callbacks.EMA.shadow_params.1",
    }
    assert open_lightning(path).ema().empty  # the table stays usable: no matching shown instead of a guess


def test_shape_mismatch_is_refused(tmp_path):
    path = _lightning_like(tmp_path, {"model.a": torch.zeros(4)}, [torch.zeros(5)])
    with pytest.raises(CheckpointError, match="no order"):
        ema_weights(path)


def test_strip_prefixes_and_collisions():
    names = ["model._orig_mod.layers.0.weight", "model.head.weight", "other.bias"]
    assert strip_prefixes(names) == {
        "model._orig_mod.layers.0.weight": "layers.0.weight", "model.head.weight": "head.weight", "other.bias": "other.bias",
    }
    assert strip_prefixes(["state_dict.model.x"], prefixes=("state_dict.model.", "state_dict.")) == {"state_dict.model.x": "x"}
    with pytest.raises(MapperError, match="would both become"):
        strip_prefixes(["model.x", "x"])


def test_align_by_order_counts_matchings():
    assert align_by_order([(2,), (3,)], [(2,), (9,), (3,)]) == ([0, 2], 1)
    assert align_by_order([(2,)], [(2,), (2,)]) == (None, 2)
    assert align_by_order([(4,)], [(2,)]) == (None, 0)


def test_non_lightning_file_is_refused():
    with pytest.raises(CheckpointError, match="Lightning"):
        open_lightning(TRAINING / "dcp_2ranks")
