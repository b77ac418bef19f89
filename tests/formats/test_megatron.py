"""Legacy Megatron checkpoints made by megatron-core itself (TP=2; TP=2 x PP=2), merged and mapped to HF.

The fixtures are committed in tests/fixtures/megatron/, made by `scripts/make_megatron_fixtures.py` (its own venv
under `.cache/fixtures/`, since megatron-core must not sit in the project venv); `make fixtures` rebuilds them and checks
the rebuild's tensors against the committed ones (tests/system/test_fixtures_committed.py). The references are megatron's: the global tensors its
`sharded_state_dict()` placement assembles, and the logits of the TP=2 model and of a TP=1 model.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "make_megatron_fixtures.py"
RUNS = ["tp2", "tp2pp2"]  # dense runs; "moe" (EP=2) has its own test
# Megatron's sharded keys name the local spec's layernorms as Transformer Engine's fused ones.
TE_NAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
            "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


@pytest.fixture(scope="module")
def megatron_root() -> Path:
    root = Path(subprocess.run([sys.executable, str(SCRIPT), "--print-root"], capture_output=True, text=True, check=True).stdout.strip())
    if not (root / "done").exists():
        if os.environ.get("WB_BUILD_FIXTURES") == "1":
            subprocess.run([sys.executable, str(SCRIPT)], check=True)
        if not (root / "done").exists():
            why = (root / "failed").read_text().strip() if (root / "failed").exists() else "not built yet"
            pytest.skip(f"Megatron fixtures unavailable ({why}); run `python scripts/make_megatron_fixtures.py`")
    return root


def _load(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def _global(reference: dict, key: str):
    """Megatron's global tensor for a TP=1 state-dict key (its sharded keys stack the layers on axis 0, and the
    experts of a layer on axis 1)."""
    m = LAYER.match(key)
    expert = re.match(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$", m[2]) if m else None
    if expert:
        return reference[f"decoder.layers.mlp.experts.experts.{expert[2]}"][int(m[1])][int(expert[1])]
    if m:
        part = TE_NAMES.get(m[2], m[2])
        return reference[f"decoder.layers.{part}"][int(m[1])]
    return reference[key]


@pytest.mark.parametrize("run", RUNS)
def test_open_lists_every_ranks_shards_where_megatron_placed_them(megatron_root: Path, run: str) -> None:
    """Each listed shard sits at the (tp, pp) and global layer megatron's ShardedTensor metadata gives it."""
    import workbench as wb

    folder = megatron_root / run
    ck = wb.open_checkpoint(folder)
    assert ck.format == "megatron"
    assert wb.open_checkpoint(folder / "iter_0000002").format == "megatron"
    catalog = ck.catalog
    meta = catalog.metadata
    tp, pp = (2, 1) if run == "tp2" else (2, 2)
    assert (meta["tp_size"], meta["pp_size"], meta["iteration"]) == (str(tp), str(pp), "2")
    assert meta["layers_per_stage"] == ("4" if pp == 1 else "2,2")
    # Megatron's placement: numel of each (tp, pp, key, global layer) as its sharded_state_dict declares it.
    declared: dict[tuple, int] = {}
    for entry in json.loads((folder / "sharding.json").read_text()):
        layer = entry["global_offset"][0] if entry["prepend_axis_num"] else None
        numel = 1
        for d in entry["local_shape"]:
            numel *= d
        where = (entry["tp"], entry["pp"], entry["key"], layer)
        declared[where] = declared.get(where, 0) + numel
    listed: dict[tuple, int] = {}
    for name, info in catalog.tensors.items():
        key = name.split("/", 1)[1]
        m = LAYER.match(key)
        layer = catalog.columns["layer"].get(name) if m else None
        sharded = f"decoder.layers.{TE_NAMES.get(m[2], m[2])}" if m else key
        where = (catalog.columns["tp"][name], catalog.columns["pp"][name], sharded, layer)
        if m:
            assert layer == (catalog.columns["pp"][name] * 2 if pp == 2 else 0) + int(m[1])
        listed[where] = info.numel
    # Replicated copies (norms on TP rank 1, the tied output layer on the last stage) are not main replicas.
    assert {k: v for k, v in listed.items() if k in declared} == declared
    extra = set(listed) - set(declared)
    assert extra and all(k[0] == 1 and re.search("layer_?norm", k[2]) or k[2] == "output_layer.weight" for k in extra), extra


@pytest.mark.parametrize("run", RUNS)
def test_args_are_recovered_without_running_the_pickle(megatron_root: Path, run: str) -> None:
    from workbench.formats.megatron import megatron_args, open_megatron

    catalog = open_megatron(megatron_root / run)
    args = megatron_args(catalog)
    assert (args["hidden_size"], args["num_attention_heads"], args["num_query_groups"], args["ffn_hidden_size"]) == (64, 4, 2, 96)
    assert args["swiglu"] is True and args["padded_vocab_size"] == 256 and args["num_layers"] == 4
    assert args["vocab_size"] == (250 if run == "tp2" else None)
    assert args["params_dtype"] == "torch.float32" and args["add_qkv_bias"] is (run == "tp2pp2")
    assert not any("optimizer" in n for n in catalog)
    # torch.load(weights_only=True) would refuse the files (the Namespace); the workbench listed them without running it
    assert catalog.metadata["weights_only"] == "no" and "argparse.Namespace" in catalog.metadata["unsafe_globals"]


@pytest.mark.parametrize("run", RUNS)
def test_merge_equals_megatrons_global_tensors(megatron_root: Path, run: str, tmp_path: Path) -> None:
    """megatron_merge's output equals, bit for bit, the global tensors megatron's own shard placement assembles."""
    import torch

    import workbench as wb
    from workbench import mapper as M

    folder = megatron_root / run
    ck = wb.open_checkpoint(folder)
    merge = M.presets.megatron_merge(ck)
    code = merge.to_code()
    assert "M.Concat(" in code and "M.Split(" in code and "same_on_every_rank" in code
    reference = _load(folder / "global_reference.safetensors")
    wb.convert(ck, tmp_path / "merged", merge, rest="drop", quiet=True)
    got = _load(tmp_path / "merged" / "model.safetensors")
    layers = {int(m[1]) for k in got if (m := LAYER.match(k))}
    assert layers == {0, 1, 2, 3}
    for key, tensor in got.items():
        want = _global(reference, key)
        if key in ("embedding.word_embeddings.weight", "output_layer.weight") and run == "tp2":
            assert tensor.shape[0] == 250 and want.shape[0] == 256  # args.vocab_size: the padding rows are cut
            want = want[:250]
        assert torch.equal(tensor, want), key
    assert ("output_layer.weight" in got) is (run == "tp2")  # tied (tp2pp2): the last stage's copy is dropped


@pytest.mark.parametrize("run", RUNS)
def test_hf_model_gives_megatrons_logits(megatron_root: Path, run: str, tmp_path: Path) -> None:
    """megatron_to_hf's output loads into transformers' Llama (tp2) / Qwen2 (tp2pp2, QKV bias, tied) without missing
    or unexpected keys and gives the logits megatron computed (TP=2 forward; TP=1 model from the global tensors)."""
    import torch
    import transformers

    import workbench as wb
    from workbench import mapper as M

    folder = megatron_root / run
    ck = wb.open_checkpoint(folder)
    options = {"vocab_size": 250} if run == "tp2pp2" else {}  # tp2pp2's args do not know the true vocabulary
    config = M.presets.megatron_hf_config(ck, **options)
    assert config["model_type"] == ("qwen2" if run == "tp2pp2" else "llama") and config["vocab_size"] == 250
    out = tmp_path / "hf"
    wb.convert(ck, out, M.presets.megatron_to_hf(ck, **options), rest="drop", quiet=True)
    (out / "config.json").write_text(json.dumps(config))
    cls = transformers.Qwen2ForCausalLM if run == "tp2pp2" else transformers.LlamaForCausalLM
    model, info = cls.from_pretrained(out, output_loading_info=True, dtype=torch.float32)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    logits = _load(folder / "logits.safetensors")
    with torch.no_grad():
        got = model.eval()(logits["input_ids"]).logits
    for key in ("logits", "logits_tp1"):
        if key in logits:
            torch.testing.assert_close(got, logits[key][..., :250], rtol=1e-5, atol=1e-5)
    assert "logits_tp1" in logits and ("logits" in logits) is (run == "tp2")


def test_only_model_bytes_are_read_and_plan_names_rank_files(megatron_root: Path, tmp_path: Path) -> None:
    import workbench as wb
    from workbench import mapper as M
    from workbench.formats.megatron import open_megatron

    folder = megatron_root / "tp2pp2"
    ck = wb.open_checkpoint(folder)
    plan = wb.plan(ck, M.presets.megatron_to_hf(ck, vocab_size=250), rest="drop")
    assert plan.ok, plan.problems
    reads = set(", ".join(plan.groups["reads_from"]).split(", "))
    assert {r.split("/")[1] for r in reads} == {"mp_rank_00_000", "mp_rank_01_000", "mp_rank_00_001", "mp_rank_01_001"}
    model_bytes = sum(info.nbytes for info in ck.catalog.tensors.values() if not info.name.endswith("output_layer.weight"))
    padding = (256 - 250) * 64 * 4  # the vocabulary padding rows are cut before anything reads them
    assert plan.bytes_read == model_bytes - padding
    with_optimizer = open_megatron(folder, optimizer=True)
    moments = [n for n in with_optimizer if n.endswith(".exp_avg_sq")]
    assert len(moments) == len(ck.catalog)  # one per parameter shard of every rank
    assert with_optimizer.open_options == {"optimizer": True}
    optimizer_bytes = sum(with_optimizer[n].nbytes for n in with_optimizer if "/optimizer." in n)
    assert optimizer_bytes > plan.bytes_read  # the moments outweigh the weights, and are not read:
    report = wb.convert(ck, tmp_path / "out", M.presets.megatron_to_hf(ck, vocab_size=250), rest="drop", quiet=True)
    assert report.bytes_read == plan.bytes_read  # measured preads: the model's byte ranges only
    assert 0 < report.peak_tensor_bytes <= report.predicted_peak_bytes


def test_suggest_and_cli_convert(megatron_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`workbench convert run/ out/ --preset megatron_to_hf` (2 worker processes) writes the HF weights; ck.suggest offers it."""
    import torch

    import workbench as wb
    from workbench.cli import main

    folder = megatron_root / "tp2"
    assert "megatron_to_hf" in list(wb.open_checkpoint(folder).suggest()["preset"])
    out = tmp_path / "cli"
    assert main(["convert", str(folder), str(out), "--preset", "megatron_to_hf", "--rest", "drop", "--nproc", "2",
                 "--shard-size", "100KB", "--quiet"]) == 0
    got: dict = {}
    for f in out.glob("*.safetensors"):
        got.update(_load(f))
    reference = _load(folder / "global_reference.safetensors")
    assert got["model.embed_tokens.weight"].shape == (250, 64)
    gate, up = got["model.layers.3.mlp.gate_proj.weight"], got["model.layers.3.mlp.up_proj.weight"]
    assert torch.equal(torch.cat([gate, up]), reference["decoder.layers.mlp.linear_fc1.weight"][3])
    assert main(["inspect", str(folder)]) == 0
    assert main(["plan", str(folder), "--preset", "megatron_to_hf", "--rest", "drop"]) == 0
    capsys.readouterr()
    assert main(["plan", str(folder / "iter_0000002"), "--preset", "megatron_merge,megatron_to_hf"]) == 2
    # chained after the merge, megatron_to_hf sees plain tensors without the checkpoint's args: it asks for config.json
    assert "without the model's config" in capsys.readouterr().err
    # --select model, and no mapper at all: the merge alone, under megatron's own names
    for options, name in ((["--select", "model"], "selected"), (["--nproc", "2"], "default")):
        assert main(["convert", str(folder), str(tmp_path / name), *options, "--quiet"]) == 0
        merged = _load(tmp_path / name / "model.safetensors")
        assert not any("/" in k for k in merged) and merged["embedding.word_embeddings.weight"].shape == (250, 64)
        assert torch.equal(merged["decoder.layers.2.self_attention.linear_qkv.weight"],
                           reference["decoder.layers.self_attention.linear_qkv.weight"][2])


def test_torch_dist_save_by_megatron_opens_and_maps_to_hf(megatron_root: Path, tmp_path: Path) -> None:
    """megatron's own torch_dist save of the TP=2 model: global tensors equal to its placement, args from common.pt,
    and megatron_to_hf writes the same HF tensors as from the legacy shards (so the same logits)."""
    import torch

    import workbench as wb
    from tests.conftest import load_checked
    from workbench import mapper as M
    from workbench.errors import MapperError

    run = megatron_root / "tp2" / "torch_dist"
    ck = wb.open_checkpoint(run)
    assert ck.format == "megatron" and ck.catalog.metadata["layout"] == "torch_dist"
    assert wb.open_checkpoint(run / "iter_0000002").format == "megatron"
    assert json.loads(ck.catalog.metadata["args.num_query_groups"]) == 2 and ck.catalog.metadata["iteration"] == "2"
    reference = _load(megatron_root / "tp2" / "global_reference.safetensors")
    assert set(ck.catalog.tensors) == set(reference)
    for name, want in reference.items():
        assert torch.equal(load_checked(ck.catalog, name), want), name
    with pytest.raises(MapperError, match="already merged"):
        M.presets.megatron_merge(ck)
    assert "megatron_to_hf" in list(ck.suggest()["preset"])
    wb.convert(ck, tmp_path / "dist", M.presets.megatron_to_hf(ck), rest="drop", quiet=True)
    legacy = wb.open_checkpoint(megatron_root / "tp2")
    wb.convert(legacy, tmp_path / "legacy", M.presets.megatron_to_hf(legacy), rest="drop", quiet=True)
    got, want = _load(tmp_path / "dist" / "model.safetensors"), _load(tmp_path / "legacy" / "model.safetensors")
    assert set(got) == set(want) and got["model.embed_tokens.weight"].shape == (250, 64)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert not (tmp_path / "dist" / "common.pt").exists()  # the run's pickled args do not travel into HF weights


def test_expert_parallel_moe_merges_to_megatrons_experts_and_loads_as_mixtral(megatron_root: Path, tmp_path: Path) -> None:
    """EP=2 MoE (mp_rank_00_EEE): the merge equals megatron's global tensors (experts renumbered across EP
    ranks, each expert's SwiGLU halves reassembled), and the HF output loads into transformers' Mixtral.
    No logits: megatron's router needs Transformer Engine's GEMM, so megatron cannot run the model on CPU."""
    import torch
    import transformers

    import workbench as wb
    from workbench import mapper as M

    folder = megatron_root / "moe"
    ck = wb.open_checkpoint(folder)
    meta = ck.catalog.metadata
    assert (meta["tp_size"], meta["pp_size"], meta["ep_size"]) == ("1", "1", "2")
    assert {ck.catalog.columns["ep"][n] for n in ck.catalog if "local_experts" in n} == {0, 1}
    reference = _load(folder / "global_reference.safetensors")
    merge = M.presets.megatron_merge(ck)
    wb.convert(ck, tmp_path / "merged", merge, rest="drop", quiet=True)
    got = _load(tmp_path / "merged" / "model.safetensors")
    experts = {int(m[1]) for k in got if (m := re.search(r"local_experts\.(\d+)\.", k))}
    assert experts == {0, 1, 2, 3}
    for key, tensor in got.items():
        want = _global(reference, key)
        assert torch.equal(tensor, want[: tensor.shape[0]] if key.startswith(("embedding", "output")) else want), key
    config = M.presets.megatron_hf_config(ck)
    assert (config["model_type"], config["num_local_experts"], config["intermediate_size"]) == ("mixtral", 4, 48)
    out = tmp_path / "hf"
    wb.convert(ck, out, M.presets.megatron_to_hf(ck), rest="drop", quiet=True)
    (out / "config.json").write_text(json.dumps(config))
    model, info = transformers.MixtralForCausalLM.from_pretrained(out, output_loading_info=True, dtype=torch.float32)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    hf = _load(out / "model.safetensors")
    fc1 = reference["decoder.layers.mlp.experts.experts.linear_fc1.weight"][1][3]
    assert torch.equal(torch.cat([hf["model.layers.1.block_sparse_moe.experts.3.w1.weight"],
                                  hf["model.layers.1.block_sparse_moe.experts.3.w3.weight"]]), fc1)


def test_missing_rank_inconsistent_tp_and_truncated_file(megatron_root: Path, tmp_path: Path) -> None:
    import workbench as wb
    from workbench.errors import CheckpointError, WorkbenchError

    run = megatron_root / "tp2pp2"
    copy = tmp_path / "run"
    shutil.copytree(run / "iter_0000002", copy / "iter_0000002")
    (copy / "latest_checkpointed_iteration.txt").write_text("2")
    shutil.rmtree(copy / "iter_0000002" / "mp_rank_01_000")
    with pytest.raises(CheckpointError, match=r"the rank folder mp_rank_01_000 is missing \(TP=2 x PP=2 needs 4\)"):
        wb.open_checkpoint(copy)
    shutil.rmtree(copy / "iter_0000002" / "mp_rank_01_001")
    with pytest.raises(CheckpointError, match="its args say tensor_model_parallel_size=2 but the rank folders make 1"):
        wb.open_checkpoint(copy)
    shutil.rmtree(copy)
    shutil.copytree(run, copy)
    victim = copy / "iter_0000002" / "mp_rank_00_001" / "model_optim_rng.pt"
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    with pytest.raises(WorkbenchError, match="mp_rank_00_001"):
        wb.open_checkpoint(copy)
    (copy / "latest_checkpointed_iteration.txt").write_text("../../elsewhere")
    assert not wb.formats.megatron.detect(copy)
    # a rank folder linked from elsewhere is not read
    linked = tmp_path / "linked" / "iter_0000002"
    linked.mkdir(parents=True)
    (linked / "mp_rank_00").symlink_to(run / "iter_0000002" / "mp_rank_00_000")
    (linked / "mp_rank_01").mkdir()
    with pytest.raises(CheckpointError, match="a link that leads outside"):
        wb.open_checkpoint(linked)


# ---------------------------------------------------------------------------------------------- hand-made layouts


def _save_run(root: Path, ranks: dict[str, dict], **args) -> Path:
    """A legacy run written the way Megatron-LM's save_checkpoint does, with hand-made shards (torch.save)."""
    import torch

    base = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=1, swiglu=False, num_layers=1)
    for folder, model in ranks.items():
        path = root / "iter_0000007" / folder / "model_optim_rng.pt"
        path.parent.mkdir(parents=True)
        torch.save({"args": argparse.Namespace(**{**base, **args}), "iteration": 7, "checkpoint_version": 3.0, **model}, path)
    (root / "latest_checkpointed_iteration.txt").write_text("7")
    return root


def test_replicas_that_differ_are_refused(tmp_path: Path) -> None:
    import torch

    import workbench as wb
    from workbench import mapper as M
    from workbench.errors import WorkbenchError

    norm = "decoder.layers.0.input_layernorm.weight"
    run = _save_run(tmp_path / "run", {
        "mp_rank_00": {"model": {norm: torch.ones(4), "decoder.layers.0.self_attention.linear_proj.weight": torch.ones(4, 2)}},
        "mp_rank_01": {"model": {norm: torch.full((4,), 2.0), "decoder.layers.0.self_attention.linear_proj.weight": torch.zeros(4, 2)}},
    })
    ck = wb.open_checkpoint(run)
    with pytest.raises(WorkbenchError, match=r"'mp_rank_01/decoder.layers.0.input_layernorm.weight' differs from it"):
        wb.convert(ck, tmp_path / "out", M.presets.megatron_merge(ck), rest="drop", quiet=True)
    lenient = M.presets.megatron_merge(ck, check_replicas=False)
    wb.convert(ck, tmp_path / "ok", lenient, rest="drop", quiet=True)
    got = _load(tmp_path / "ok" / "model.safetensors")
    assert torch.equal(got[norm], torch.ones(4))
    assert torch.equal(got["decoder.layers.0.self_attention.linear_proj.weight"], torch.cat([torch.ones(4, 2), torch.zeros(4, 2)], dim=1))


def test_without_a_mapper_the_format_names_the_preset_and_planning_resolves_it(tmp_path: Path, llama_sample: Path) -> None:
    """The no-mapper default is a hook of the reader (`Catalog.default_preset`), not a Megatron branch in planning:
    a legacy run names the TP/PP merge, a merged layout names none, and any catalog that names a preset plans through it."""
    import torch

    import workbench as wb
    from workbench.formats import open_catalog

    proj = "decoder.layers.0.self_attention.linear_proj.weight"
    run = _save_run(tmp_path / "run", {
        "mp_rank_00": {"model": {proj: torch.ones(4, 2)}}, "mp_rank_01": {"model": {proj: torch.zeros(4, 2)}},
    })
    catalog = open_catalog(run)
    assert catalog.default_preset == "megatron_merge"
    plan = wb.plan(catalog)
    assert plan.ok and list(plan.outputs.index) == [proj] and tuple(plan.outputs.loc[proj, "shape"]) == (4, 4)
    sample = open_catalog(llama_sample)
    assert sample.default_preset == ""
    sample.default_preset = "strip_prefix"
    names = list(wb.plan(sample).outputs.index)
    assert names and not any(name.startswith("model.") for name in names)


def test_moe_virtual_pipeline_and_unknown_layouts_are_refused(tmp_path: Path) -> None:
    import torch

    import workbench as wb
    from workbench import mapper as M
    from workbench.errors import CheckpointError, MapperError

    expert = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"
    # mp_rank_TT_EEE: expert ranks (the args say EP=2, PP=1), whose 3 experts cannot be shared evenly
    moe = _save_run(tmp_path / "moe", {f"mp_rank_00_00{e}": {"model": {expert: torch.ones(2, 2)}} for e in range(2)},
                    tensor_model_parallel_size=1, expert_model_parallel_size=2, num_experts=3)
    ck = wb.open_checkpoint(moe)
    assert ck.catalog.metadata["ep_size"] == "2" and ck.catalog.metadata["pp_size"] == "1"
    with pytest.raises(MapperError, match="num_experts=3, which 2 expert-parallel ranks cannot share evenly"):
        M.presets.megatron_merge(ck)
    grouped = _save_run(tmp_path / "grouped", {f"mp_rank_0{t}": {"model": {"decoder.layers.0.mlp.experts.weight1": torch.ones(2)}}
                                               for t in range(2)})
    with pytest.raises(MapperError, match="its tensor-parallel layout is not known"):
        M.presets.megatron_merge(wb.open_checkpoint(grouped))
    odd = _save_run(tmp_path / "odd", {f"mp_rank_0{t}": {"model": {"decoder.layers.0.mystery.weight": torch.ones(2)}} for t in range(2)})
    with pytest.raises(MapperError, match="its tensor-parallel layout is not known"):
        M.presets.megatron_merge(wb.open_checkpoint(odd))
    vp = _save_run(tmp_path / "vp", {f"mp_rank_0{t}": {"model0": {}, "model1": {}} for t in range(2)})
    with pytest.raises(CheckpointError, match="virtual pipeline chunks"):
        wb.open_checkpoint(vp)
