"""Training checkpoints as conversion sources: every sample format to HF safetensors (equal to real readers),
files opened == the plan's files_read, model selection, and Lightning extraction with EMA weights."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import workbench as wb
from workbench import mapper as M
from workbench.cli import commands as cli
from workbench.errors import CheckpointError
from workbench.formats import open_catalog
from workbench.training.extract import lightning_mapper, lightning_matching, model_tensors, select_mapper

TRAINING = Path(__file__).resolve().parents[2] / "sample_checkpoints" / "training"
SAMPLES = ["dcp_2ranks", "dcp_pp", "lightning/ema.ckpt", "lightning/torch_ema.ckpt", "lightning_fsdp.ckpt", "atorch_flat",
           "torch/pytorch_model.bin", "torch/trainer_state.pt"]
PARAMS = ["0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias"]  # TinyLit.model's named_parameters()
BUFFERS = ["1.running_mean", "1.running_var", "1.num_batches_tracked"]


def flatten(tree, prefix: str = "") -> dict:
    """Tensors of a nested dict/list tree by dotted path (how the workbench names them)."""
    out = {}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    for key, value in items:
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            out[name] = value
        else:
            out.update(flatten(value, name + "."))
    return out


def torch_dcp_load(path: Path, tmp_path: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / (path.name + ".pt")
    dcp_to_torch_save(path, out)
    return flatten(torch.load(out, weights_only=True))


def real_reader(sample: str, tmp_path: Path) -> dict:
    """The sample's tensors as the framework that wrote it reads them."""
    path = TRAINING / sample
    if sample == "dcp_pp":  # one DCP per stage: each is read by torch on its own
        return {**torch_dcp_load(path / "pp1", tmp_path), **torch_dcp_load(path / "pp0", tmp_path)}
    if sample.startswith("dcp") or sample == "lightning_fsdp.ckpt":
        tensors = torch_dcp_load(path, tmp_path)
        if (path / "meta.pt").exists():
            tensors.update(flatten(torch.load(path / "meta.pt", weights_only=True), "meta."))
        return tensors
    if sample == "atorch_flat":
        return load_file(TRAINING / "atorch_flat_expected.safetensors")
    with torch.serialization.safe_globals([argparse.Namespace]):
        return flatten(torch.load(path, weights_only=True))


def hf_tensors(folder: Path) -> dict:
    out = {}
    for shard in sorted(folder.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


def assert_opened_as_planned(report, plan) -> None:
    assert report.files_match_plan
    assert report.files_opened == sorted(plan.files_read["path"])
    assert report.bytes_read == plan.bytes_read == int(plan.files_read["bytes_read"].sum())


@pytest.mark.parametrize("sample", SAMPLES)
def test_each_sample_converts_to_hf_equal_to_its_real_reader(sample: str, tmp_path: Path) -> None:
    catalog = open_catalog(TRAINING / sample)
    plan = wb.plan(catalog, dest=tmp_path / "hf", shard_size="1KB")
    report = wb.convert(catalog, tmp_path / "hf", shard_size="1KB", quiet=True)
    assert_opened_as_planned(report, plan)
    got = hf_tensors(tmp_path / "hf")
    expected = real_reader(sample, tmp_path)
    assert set(got) == set(catalog.tensors) == set(expected)
    for name in got:  # equal to the reader's own tensors and to the framework's
        assert torch.equal(got[name], catalog_tensor(catalog, name)), name
        assert torch.equal(got[name], expected[name]), name


def catalog_tensor(catalog, name: str) -> torch.Tensor:
    from workbench.dtypes import to_torch

    info = catalog[name]
    raw = bytearray(catalog.read_bytes(name))
    return torch.frombuffer(raw, dtype=to_torch(info.dtype)).reshape(info.shape) if raw else torch.empty(info.shape, dtype=to_torch(info.dtype))


def files_holding(catalog, name: str) -> set[str]:
    """The files that hold a piece of a tensor, from the reader's own chunk/piece lists."""
    reader = catalog.reader
    if name.startswith("meta.") and name not in getattr(reader, "tensors", {}):
        return {"meta.pt"}
    entry = reader.tensors[name]
    parts = entry.chunks if hasattr(entry, "chunks") else entry.pieces
    sizes = [math.prod(p.sizes) if hasattr(p, "sizes") else p.end - p.start for p in parts]
    return {p.file for p, n in zip(parts, sizes, strict=True) if n}


@pytest.mark.parametrize("sample", ["dcp_2ranks", "dcp_pp", "lightning_fsdp.ckpt", "atorch_flat"])
def test_files_opened_equal_files_read_for_each_tensor(sample: str, tmp_path: Path) -> None:
    """Tensors assembled from several files (DCP chunks, atorch flat pieces): the plan lists every file they touch."""
    catalog = open_catalog(TRAINING / sample)  # one catalog reused: cached descriptors must not hide opens
    spread = [n for n in catalog.tensors if len(files_holding(catalog, n)) > 1]
    if sample in ("dcp_2ranks", "atorch_flat"):
        assert spread  # the samples do hold tensors spread over two ranks' files
    names = spread + [n for n in catalog.tensors if n not in spread][:3]
    for k, name in enumerate(names):
        for to in ("safetensors", "dcp"):
            dest = tmp_path / f"{k}-{to}"
            plan = wb.plan(catalog, M.Identity(name), rest="drop", dest=dest, to=to)
            report = wb.convert(catalog, dest, M.Identity(name), rest="drop", quiet=True, to=to)
            assert_opened_as_planned(report, plan)
            assert set(plan.files_read["file"]) == files_holding(catalog, name)


def test_select_model_strips_trainer_prefixes_per_format(tmp_path: Path) -> None:
    assert model_tensors(open_catalog(TRAINING / "dcp_2ranks")) == {
        f"model.{n}": n for n in ["embed.weight", "layers.0.weight", "head.weight", "layers.0.bias", "norm.weight"]}
    atorch = model_tensors(open_catalog(TRAINING / "atorch_flat"))
    assert "proj-out.weight" in atorch and "scale" in atorch and not any(n.startswith("optimizer") for n in atorch)
    assert model_tensors(open_catalog(TRAINING / "torch" / "trainer_state.pt")) == {"model.w": "w"}
    assert model_tensors(open_catalog(TRAINING / "lightning_fsdp.ckpt")) == {f"model.model.{n}": n for n in PARAMS[:4] + BUFFERS + PARAMS[4:]}
    compiled = tmp_path / "compiled.pt"
    torch.save({"model": {"_orig_mod.layer.weight": torch.ones(2, 2)}, "optimizer": {"state": {0: {"exp_avg": torch.ones(2, 2)}}}}, compiled)
    mapper, rest = select_mapper(compiled, "model")
    report = wb.convert(compiled, tmp_path / "out", mapper, rest=rest, quiet=True)
    assert report.ok and list(load_file(tmp_path / "out" / "model.safetensors")) == ["layer.weight"]
    assert select_mapper(compiled, "all") == (None, "keep")


def test_dcp_model_only_or_with_optimizer_state(tmp_path: Path) -> None:
    mapper, rest = select_mapper(TRAINING / "dcp_2ranks", "model")
    wb.convert(TRAINING / "dcp_2ranks", tmp_path / "model", mapper, rest=rest, quiet=True)
    expected = torch_dcp_load(TRAINING / "dcp_2ranks", tmp_path)
    model = load_file(tmp_path / "model" / "model.safetensors")
    assert set(model) == {"embed.weight", "layers.0.weight", "layers.0.bias", "head.weight", "norm.weight"}
    assert all(torch.equal(model[k], expected["model." + k]) for k in model)
    wb.convert(TRAINING / "dcp_2ranks", tmp_path / "all", quiet=True)
    assert "optimizer.state.head.weight.exp_avg" in load_file(tmp_path / "all" / "model.safetensors")


# ---------------------------------------------------------------------------------------------- Lightning


def strip_model(tensors: dict) -> dict:
    return {k.removeprefix("model."): v for k, v in tensors.items()}


def test_weight_averaging_ckpt_extracts_the_average_or_the_live_weights(tmp_path: Path) -> None:
    raw = torch.load(TRAINING / "lightning" / "ema.ckpt", weights_only=True)
    table = lightning_matching(TRAINING / "lightning" / "ema.ckpt")
    assert list(table.index) == PARAMS[:4] + BUFFERS + PARAMS[4:] and set(table["taken_from"]) == {"ema (by name)"}
    report = wb.lightning_to_hf(TRAINING / "lightning" / "ema.ckpt", tmp_path / "ema", quiet=True)
    assert report.files_match_plan
    got = load_file(tmp_path / "ema" / "model.safetensors")
    average, current = strip_model(raw["state_dict"]), strip_model(raw["current_model_state"])
    assert got.keys() == average.keys() == current.keys()
    # The sample was saved mid-run, so the average lags the live weights: every tensor tells them apart.
    assert all(not torch.equal(average[k], current[k]) for k in average)
    assert all(torch.equal(got[k], v) for k, v in average.items())
    wb.lightning_to_hf(TRAINING / "lightning" / "ema.ckpt", tmp_path / "live", ema=False, quiet=True)
    live = load_file(tmp_path / "live" / "model.safetensors")
    assert live.keys() == current.keys() and all(torch.equal(live[k], v) for k, v in current.items())
    assert all(not torch.equal(got[k], live[k]) for k in got)
    assert all(s.startswith("state_dict.") for s in table["source"])
    assert all(s.startswith("current_model_state.") for s in lightning_matching(TRAINING / "lightning" / "ema.ckpt", ema=False)["source"])


def test_torch_ema_shadow_list_is_applied_in_parameter_order(tmp_path: Path) -> None:
    path = TRAINING / "lightning" / "torch_ema.ckpt"
    raw = torch.load(path, weights_only=True)
    shadow = raw["callbacks"]["ShadowEMA"]["shadow_params"]
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    order = [n for n, _ in model.named_parameters()]
    assert order == PARAMS
    expected = {**dict(zip(order, shadow, strict=True)), **{b: raw["state_dict"]["model." + b] for b in BUFFERS}}
    table = lightning_matching(path)
    assert (table.loc[PARAMS, "taken_from"] == "ema (by order)").all() and (table.loc[BUFFERS, "taken_from"] == "model").all()
    for name, params in (("auto", None), ("module", model)):
        wb.lightning_to_hf(path, tmp_path / name, param_names=params, quiet=True)
        got = load_file(tmp_path / name / "model.safetensors")
        assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)


def test_sharded_fsdp_lightning_folder_with_named_ema(tmp_path: Path) -> None:
    path = TRAINING / "lightning_fsdp.ckpt"
    shadow = torch.load(path / "meta.pt", weights_only=True)["callbacks"]["ShadowEMA"]["shadow"]
    buffers = torch_dcp_load(path, tmp_path)
    expected = {**strip_model(shadow), **{b: buffers["model.model." + b] for b in BUFFERS}}
    plan = wb.plan(path, lightning_mapper(path), rest="drop")  # dry-run first: the same mapper wb.lightning_to_hf uses
    assert set(plan.outputs.index) == set(expected) and plan.ok
    assert sorted(plan.files_read["file"]) == ["__0_0.distcp", "meta.pt"]
    report = wb.lightning_to_hf(path, tmp_path / "hf", quiet=True)
    assert report.files_match_plan
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)
    wb.lightning_to_hf(path, tmp_path / "dcp", to="dcp", quiet=True)  # the same extraction as a DCP folder
    again = torch_dcp_load(tmp_path / "dcp", tmp_path)
    assert again.keys() == expected.keys() and all(torch.equal(again[k], expected[k]) for k in expected)


def test_ambiguous_ema_order_is_refused_then_resolved(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    weights = {f"model.{n}.weight": torch.randn(4, 4, generator=gen) for n in "abc"}
    shadow = [torch.randn(4, 4, generator=gen) for _ in range(2)]
    path = tmp_path / "amb.ckpt"
    torch.save({"pytorch-lightning_version": "2.6.0", "state_dict": weights, "callbacks": {"EMA": {"shadow_params": shadow}}}, path)
    with pytest.raises(CheckpointError, match="more than one set of parameters"):
        wb.lightning_to_hf(path, tmp_path / "out", quiet=True)
    assert not (tmp_path / "out").exists()
    wb.lightning_to_hf(path, tmp_path / "out", param_names=["a.weight", "c.weight"], quiet=True)
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert torch.equal(got["a.weight"], shadow[0]) and torch.equal(got["c.weight"], shadow[1])
    assert torch.equal(got["b.weight"], weights["model.b.weight"])  # no EMA copy: the live weight


def test_cli_lightning_weights_select_and_dcp(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = TRAINING / "lightning" / "torch_ema.ckpt"
    assert cli.main(["convert", str(path), str(tmp_path / "a"), "--lightning-weights", "ema", "--quiet"]) == 0
    wb.lightning_to_hf(path, tmp_path / "b", quiet=True)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    capsys.readouterr()
    assert cli.main(["convert", str(TRAINING / "dcp_pp"), str(tmp_path / "c"), "--select", "model", "--to", "dcp", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "(DCP)" in out and "__0_0.distcp" in out and not (tmp_path / "c").exists()
    assert cli.main(["plan", str(path), "--select", "model", "--lightning-weights", "ema"]) == 2
    assert "--select and --lightning-weights" in capsys.readouterr().err
    assert cli.main(["convert", str(TRAINING / "atorch_flat"), str(tmp_path / "d"), "--lightning-weights", "ema"]) == 2
    assert "as a Lightning checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize("sample", SAMPLES)
def test_inspect_and_explorer_show_every_sample(sample: str, capsys: pytest.CaptureFixture) -> None:
    from workbench.widgets import Explorer

    catalog = open_catalog(TRAINING / sample)
    assert cli.main(["inspect", str(TRAINING / sample)]) == 0
    out = capsys.readouterr().out
    first = next(iter(catalog.tensors))
    assert catalog.format in out and first.split(".")[-1] in out
    explorer = Explorer(wb.open_checkpoint(TRAINING / sample))
    assert f"of {len(catalog)} tensors" in explorer.count_label.value and "<table" in explorer.table.value


def test_plan_of_a_sharded_source_reads_no_tensor_data() -> None:
    from workbench.iostats import IO

    catalog = open_catalog(TRAINING / "atorch_flat")
    IO.reset()
    plan = wb.plan(catalog, to="dcp")
    assert plan.ok and IO.snapshot()["bytes_read"] == 0
    assert os.path.basename(plan.output_file_list[0].name) == "__0_0.distcp"
