"""atorch flat-parameter checkpoints: full parameters and optimizer state reassembled across rank files."""

from __future__ import annotations

import pickle

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import SAMPLES, load_checked
from workbench.errors import CheckpointError
from workbench.formats import open_catalog
from workbench.formats.atorch import _split_state_key, shard_pieces, unit_layout, write_flat_checkpoint
from workbench.formats.pickle.unpickler import load_inert

SAMPLE = SAMPLES / "training" / "atorch_flat"


def _units(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        "": {"embed.weight": torch.randn(11, 3, generator=gen), "final-norm.weight": torch.randn(3, generator=gen)},
        "layers.0": {"attn-qkv.weight": torch.randn(9, 3, generator=gen), "attn-qkv.bias": torch.randn(9, generator=gen)},
        "layers.1": {"mlp.weight": torch.randn(5, 3, generator=gen).bfloat16(), "mlp.bias": torch.randn(5, generator=gen).bfloat16()},
    }


def _full(units: dict) -> dict[str, torch.Tensor]:
    return {(f"{u}.{n}" if u else n): t for u, params in units.items() for n, t in params.items()}


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_reassembly_equals_the_full_tensors(tmp_path, world_size):
    units = _units()
    full = _full(units)
    optim = {k: {"exp_avg": v.float().mul(0.5).to(v.dtype), "exp_avg_sq": v.float().square().to(v.dtype), "step": torch.tensor(4.0)} for k, v in full.items()}
    write_flat_checkpoint(tmp_path, units, world_size, buffers={"rope.inv_freq": torch.arange(4.0)}, optim_state=optim)
    catalog = open_catalog(tmp_path)
    assert catalog.format == "atorch-flat" and catalog.metadata["world_size"] == str(world_size)
    for name, tensor in full.items():
        assert torch.equal(load_checked(catalog, name), tensor), name
        for state, value in optim[name].items():
            assert torch.equal(load_checked(catalog, f"optimizer.state.{name}.{state}"), value), (name, state)
    assert torch.equal(load_checked(catalog, "rope.inv_freq"), torch.arange(4.0))
    assert catalog.columns["unit"]["layers.0.attn-qkv.weight"] == "layers.0"
    if world_size > 1:
        assert max(catalog.columns["pieces"].values()) > 1


def test_sample_from_real_fsdp_matches_its_full_state():
    expected = load_file(SAMPLE.parent / "atorch_flat_expected.safetensors")
    catalog = open_catalog(SAMPLE)
    assert set(catalog.tensors) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(load_checked(catalog, name), tensor), name
    assert "proj-out.weight" in catalog and "optimizer.state.proj-out.weight.exp_avg" in catalog
    assert catalog.metadata["wrap_class"] == "torch.nn.modules.linear.Linear"


def test_sample_layout_follows_fsdp_flat_parameter_rules():
    """The real FSDP shards in the sample sit exactly where unit_layout/shard_pieces put them."""
    world = 2
    for rank in range(world):
        meta = load_inert((SAMPLE / f"flat_meta.{rank:05d}-{world:05d}").read_bytes(), source="flat_meta").root
        for unit, flat in meta["flat_param_meta"].items():
            numels = list(flat["numels"])
            starts, total = unit_layout(numels, 4, world)
            assert total // world == flat["flat_numel"]
            in_unit = [m for m in meta["param_meta"].values() if m["striped_fsdp_name"] == unit]
            predicted = [(off, off + n) for _, off, n, _ in shard_pieces(starts, numels, total, world, rank)]
            assert [tuple(m["param_offsets"]) for m in in_unit] == predicted


def test_state_keys_with_dashes_split_on_the_known_part():
    assert _split_state_key("proj-out.weight-exp_avg", {"proj-out.weight"}) == ("proj-out.weight", "exp_avg")
    assert _split_state_key("a-b.c-exp_avg_sq", set()) == ("a-b.c", "exp_avg_sq")
    assert _split_state_key("x-y-custom", {"x-y"}) == ("x-y", "custom")


def _written(tmp_path):
    write_flat_checkpoint(tmp_path, _units(), 2, buffers={"b": torch.ones(2)})
    return tmp_path


@pytest.mark.parametrize("damage", ["missing_rank", "foreign_global", "truncated_shard", "world_mismatch"])
def test_damaged_checkpoints_raise_checkpoint_error(tmp_path, damage):
    folder = _written(tmp_path)
    if damage == "missing_rank":
        (folder / "flat_param.00001-00002").unlink()
    elif damage == "foreign_global":
        (folder / "flat_meta.00000-00002").write_bytes(pickle.dumps({"param_meta": print}))
    elif damage == "truncated_shard":
        shard = folder / "flat_param.00000-00002"
        shard.write_bytes(shard.read_bytes()[:-8])
    else:
        (folder / "ckpt_meta").write_bytes(pickle.dumps({"version": 1, "world_size": 4}))
    with pytest.raises(CheckpointError) as err:
        open_catalog(folder)
    assert str(folder) in str(err.value)
