"""Build real legacy Megatron checkpoints (TP=2, TP=2 x PP=2) and Megatron's own references in a cache folder.

megatron-core must not sit in the project venv, so this script creates its own venv under
`.cache/fixtures/venv-megatron-<pin>-torch-<ver>/` (torch + megatron-core + safetensors) and builds small
GPT models there with `torchrun` on gloo (CPU, `use_cpu_initialization=True`, the local layer spec):

- `tp2/`: TP=2, Llama-like (RMSNorm, SwiGLU, GQA 4 heads / 2 query groups, RoPE, untied output layer, no biases),
  true vocabulary 250 padded to 256 (`args.vocab_size` set).
  `tp2/torch_dist/`: the same model saved by megatron's `dist_checkpointing` in the `torch_dist` format (a DCP
  folder of global tensors, args in `common.pt`), as Megatron-LM's --use-dist-ckpt writes it.
- `moe/`: EP=2 (2 processes), the Llama-like model with mixture-of-experts MLPs (4 experts, top-2, SwiGLU
  experts, sequential local experts), `mp_rank_TT_EEE` folders; no forward (megatron's router needs Transformer
  Engine's GEMM), so its reference is the global tensors only. (MoE with TP needs sequence parallelism, which
  the local spec's torch norms refuse, so experts are not tensor-parallel here.)
- `tp2pp2/`: TP=2 x PP=2 (4 processes), Qwen2-like (QKV bias, tied embeddings), `args.vocab_size` None (the true
  vocabulary is only in the HF config, as with HF tokenizers).

Each run folder holds what Megatron-LM's legacy `save_checkpoint` writes (`latest_checkpointed_iteration.txt`,
`iter_0000002/mp_rank_TT[_PPP]/model_optim_rng.pt` with `args` (an argparse.Namespace), `checkpoint_version`,
`iteration`, `model`, `optimizer`, `rng_state`), plus references computed by megatron-core itself:
- `global_reference.safetensors`: every parameter assembled from the ranks' local shards by the placement
  megatron's `sharded_state_dict()` declares (ShardedTensor global shape / offsets, the SwiGLU factory applied),
  under megatron's sharded keys (layers stacked on a leading axis, as `torch_dist` stores them);
  `sharding.json`: that metadata per rank;
- `logits.safetensors`: `input_ids` and the full-vocabulary logits of the parallel model (TP=2 run: gathered
  from the TP ranks) and `logits_tp1` of a TP=1 megatron model loaded from the global reference.
Building and running on CPU needs five patches that only concern devices (no CUDA here): `torch.cuda.current_device`
answers "cpu" (RoPE frequencies), `Tensor.cuda` returns the tensor (the tied output layer's initial sync),
`torch.cuda.synchronize` does nothing (torch_dist's writer), an explicit causal mask is passed (the default one
is built on "cuda"), and the CUDA RNG tracker's `fork` is a no-op (dropout is 0). The torch_dist save also needs
psutil in the venv: without it megatron's writer process dies and the save waits forever (the "hang" seen
before), and the script's code under `if __name__ == "__main__"` (the writer is a spawned process).

Re-running is a no-op when the `done` marker exists. Usage: python scripts/make_megatron_fixtures.py
[--print-root (the committed copy the tests read: tests/fixtures/megatron) | --print-built-root (this build)
| --commit (build, then replace the committed copy and its MANIFEST.json)]
`--sample DIR` instead writes the notebook's small TP=2 x PP=2 sample (model only) to DIR
(`sample_checkpoints/training/megatron_tp2pp2`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

TORCH = "2.13.0"
MEGATRON = os.environ.get("WB_MEGATRON_VERSION", "")  # empty: what the resolver picks, recorded after install
REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache" / "fixtures"
COMMITTED = REPO / "tests" / "fixtures" / "megatron"  # what the tests read: a copy of one build, see --commit
FIXTURE_VERSION = 3  # bump when what the fixtures hold changes

MODEL = r'''
import contextlib, json, os, random, sys
import numpy as np
import torch
import torch.nn.functional as F

torch.cuda.current_device = lambda: "cpu"  # RoPE asks for the device of its frequencies; there is no GPU here
torch.Tensor.cuda = lambda self, *a, **k: self  # the tied output layer's first sync moves it to "cuda" first
torch.cuda.synchronize = lambda *a, **k: None  # torch_dist's writer waits for the GPU before copying tensors
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories, is_main_replica
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.transformer.transformer_config import TransformerConfig

VARIANTS = {
    "tp2": dict(tp=2, pp=1, qkv_bias=False, tied=False, vocab_size=250),
    "tp2pp2": dict(tp=2, pp=2, qkv_bias=True, tied=True, vocab_size=None),
    "sample": dict(tp=2, pp=2, qkv_bias=False, tied=False, vocab_size=60),
    "moe": dict(tp=1, pp=1, ep=2, qkv_bias=False, tied=False, vocab_size=250, experts=4),
}
MOE_FFN = 48
SMALL = os.environ.get("WB_MEGATRON_SMALL") == "1"  # the notebook sample: as small as the layout allows
LAYERS, HIDDEN, HEADS, GROUPS, FFN, PADDED, SEQ, DIVISIBLE = (2, 32, 4, 2, 48, 64, 8, 32) if SMALL else (4, 64, 4, 2, 96, 256, 8, 64)


def build(variant, tp, pp):
    torch.distributed.init_process_group("gloo")
    ep, experts = variant.get("ep", 1), variant.get("experts")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             expert_model_parallel_size=ep)
    get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    torch.manual_seed(1234)
    cfg = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS, ffn_hidden_size=FFN,
        use_cpu_initialization=True, gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm",
        layernorm_epsilon=1e-6, add_bias_linear=False, add_qkv_bias=variant["qkv_bias"], bias_activation_fusion=False,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0, masked_softmax_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False,
        **(dict(num_moe_experts=experts, moe_router_topk=2, moe_ffn_hidden_size=MOE_FFN, expert_model_parallel_size=ep,
                moe_token_dispatcher_type="allgather", moe_grouped_gemm=False, sequence_parallel=tp > 1) if experts else {}))
    spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False) if experts else get_gpt_layer_local_spec()
    model = GPTModel(cfg, transformer_layer_spec=spec, vocab_size=PADDED, max_sequence_length=64,
                     position_embedding_type="rope", rotary_base=10000, share_embeddings_and_output_weights=variant["tied"],
                     pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage())
    return cfg, model


def args_namespace(variant, tp, pp):
    """The training arguments Megatron-LM pickles as `args` (an argparse.Namespace), for the fields converters read."""
    import argparse
    return argparse.Namespace(
        num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS, group_query_attention=True,
        num_query_groups=GROUPS, kv_channels=HIDDEN // HEADS, swiglu=True, normalization="RMSNorm", norm_epsilon=1e-6,
        position_embedding_type="rope", rotary_base=10000, max_position_embeddings=64, seq_length=SEQ,
        add_bias_linear=False, add_qkv_bias=variant["qkv_bias"], untie_embeddings_and_output_weights=not variant["tied"],
        padded_vocab_size=PADDED, vocab_size=variant["vocab_size"], make_vocab_size_divisible_by=DIVISIBLE,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=variant.get("ep", 1),
        num_experts=variant.get("experts"), moe_ffn_hidden_size=MOE_FFN if variant.get("experts") else None,
        moe_router_topk=2 if variant.get("experts") else None, sequence_parallel=bool(variant.get("experts")),
        params_dtype=torch.float32, bf16=False, fp16=False, transformer_impl="local", use_dist_ckpt=False,
        ckpt_format="torch", iteration=2, consumed_train_samples=16, tokenizer_type="HuggingFaceTokenizer")


def perturb(model, tp_rank, pp_rank, tied, ep_rank=0):
    """Move every weight off its initial value, deterministically and unlike any other stage's or rank's weight
    (every stage starts from the same seed), alike on every TP rank for replicated ones (norms), and alike for the
    tied embedding and output layer."""
    import zlib
    for name, p in model.named_parameters():
        key = "embedding.word_embeddings.weight" if tied and name == "output_layer.weight" else name
        stage = "" if key.startswith(("embedding.", "output_layer.")) else f"|pp{pp_rank}"
        shard = "" if "layernorm" in name or ".router." in name else f"|tp{tp_rank}"
        shard += f"|ep{ep_rank}" if ".experts." in name else ""  # dense weights are data-parallel copies on EP ranks
        g = torch.Generator().manual_seed(zlib.crc32(f"{key}{stage}{shard}".encode()))
        with torch.no_grad():
            p.add_(0.05 * torch.randn(p.shape, generator=g))


def global_tensors(model):
    """Megatron's own placement of every local shard in its global tensor, gathered to rank 0 (None elsewhere)."""
    ssd = model.sharded_state_dict()
    apply_factories(ssd)
    mine = []
    where = dict(tp=parallel_state.get_tensor_model_parallel_rank(), pp=parallel_state.get_pipeline_model_parallel_rank(),
                 ep=parallel_state.get_expert_model_parallel_rank())
    for sh in nested_values(ssd):
        if isinstance(sh, ShardedTensor) and is_main_replica(sh.replica_id):
            mine.append(dict(**where, key=sh.key, global_shape=list(sh.global_shape), global_offset=list(sh.global_offset),
                             axis_fragmentations=list(sh.axis_fragmentations), prepend_axis_num=sh.prepend_axis_num,
                             local_shape=list(sh.local_shape), data=sh.data.detach().clone().contiguous()))
    everything = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everything, mine)
    if torch.distributed.get_rank() != 0:
        return None, None
    full, filled, meta = {}, {}, []
    for rank, shards in enumerate(everything):
        for s in shards:
            t = full.setdefault(s["key"], torch.zeros(s["global_shape"], dtype=s["data"].dtype))
            f = filled.setdefault(s["key"], torch.zeros(s["global_shape"], dtype=torch.int32))
            pre = s["prepend_axis_num"]
            index = tuple(slice(o, o + 1) if d < pre else slice(o, o + n)
                          for d, (o, n) in enumerate(zip(s["global_offset"], [1] * pre + list(s["local_shape"]))))
            t[index] = s["data"].reshape(t[index].shape)
            f[index] += 1
            meta.append({"rank": rank, **{k: v for k, v in s.items() if k != "data"}})
    for key, f in filled.items():
        assert bool((f == 1).all()), f"{key}: megatron's shards do not cover the global tensor exactly once"
    return full, meta


def logits_of(model, tp):
    model.eval()
    ids = torch.randint(0, 250, (1, SEQ), generator=torch.Generator().manual_seed(0))
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ), diagonal=1).bool()
    with torch.no_grad():
        local = model(ids, torch.arange(SEQ).unsqueeze(0), attention_mask=mask)
    parts = [torch.empty_like(local) for _ in range(tp)]
    torch.distributed.all_gather(parts, local.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return ids, torch.cat(parts, dim=-1)


def save_torch_dist(model, legacy, run):
    """The same model saved by megatron's dist_checkpointing in its `torch_dist` format, as Megatron-LM's
    `save_checkpoint` does with --use-dist-ckpt: args and counters in common.pt, the model's sharded state dict."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    folder = os.path.join(run, "iter_0000002")
    if torch.distributed.get_rank() == 0:
        os.makedirs(folder, exist_ok=True)
    torch.distributed.barrier()
    state = {k: legacy[k] for k in ("args", "checkpoint_version", "iteration")}
    state["model"] = model.sharded_state_dict()
    dist_checkpointing.save(state, folder, TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1))
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(run, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("2")


def save(variant_name, out):
    variant = VARIANTS[variant_name]
    tp, pp = variant["tp"], variant["pp"]
    cfg, model = build(variant, tp, pp)
    tp_rank, pp_rank = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    perturb(model, tp_rank, pp_rank, variant["tied"], parallel_state.get_expert_model_parallel_rank())
    # One optimizer step with gradients that are equal on replicas, so the checkpoint carries Adam moments.
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = 0.1 * p.detach().clone()
    opt.step()
    state = {
        "args": args_namespace(variant, tp, pp), "checkpoint_version": 3.0, "iteration": 2,
        "model": model.state_dict_for_save_checkpoint(),
        "optimizer": {"optimizer": opt.state_dict(), "fp32_from_fp16_params": []},
        "opt_param_scheduler": {"max_lr": 1e-3, "num_steps": 16},
        "rng_state": [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                       "torch_rng_state": torch.get_rng_state()}],
        "num_floating_point_operations_so_far": 0,
    }
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    folder = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "") + (f"_{ep_rank:03d}" if variant.get("ep", 1) > 1 else "")
    path = os.path.join(out, "iter_0000002", folder, "model_optim_rng.pt")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if variant_name == "sample":  # the committed notebook sample: the model only (no optimizer, no RNG states)
        torch.save({k: state[k] for k in ("args", "checkpoint_version", "iteration", "model")}, path)
        torch.distributed.barrier()
        if torch.distributed.get_rank() == 0:
            with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write("2")
        return
    torch.save(state, path)
    if variant_name == "tp2":
        save_torch_dist(model, state, os.path.join(out, "torch_dist"))
    full, meta = global_tensors(model)
    logits = logits_of(model, tp) if pp == 1 and not variant.get("experts") else None  # MoE router: TE-only GEMM
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        from safetensors.torch import save_file
        save_file(full, os.path.join(out, "global_reference.safetensors"))
        with open(os.path.join(out, "sharding.json"), "w") as f:
            json.dump(meta, f, indent=1)
        if logits is not None:
            save_file({"input_ids": logits[0], "logits": logits[1]}, os.path.join(out, "logits.safetensors"))
        with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("2")


def load_tp1(variant_name, out):
    """A TP=1 megatron model whose shards are filled from the global reference: megatron's own logits for it."""
    from safetensors.torch import load_file, save_file
    variant = VARIANTS[variant_name]
    cfg, model = build(variant, 1, 1)
    full = load_file(os.path.join(out, "global_reference.safetensors"))
    ssd = model.sharded_state_dict()
    apply_factories(ssd)
    loaded = set()
    for sh in nested_values(ssd):
        if not isinstance(sh, ShardedTensor):
            continue
        pre = sh.prepend_axis_num
        index = tuple(slice(o, o + 1) if d < pre else slice(o, o + n)
                      for d, (o, n) in enumerate(zip(sh.global_offset, [1] * pre + list(sh.local_shape))))
        with torch.no_grad():
            sh.data.copy_(full[sh.key][index].reshape(sh.data.shape))
        loaded.add(sh.key)
    assert loaded == set(full), sorted(set(full) ^ loaded)
    ids, logits = logits_of(model, 1)
    path = os.path.join(out, "logits.safetensors")
    have = load_file(path) if os.path.exists(path) else {"input_ids": ids}
    assert torch.equal(have["input_ids"], ids)
    have["logits_tp1"] = logits
    save_file(have, path)


if __name__ == "__main__":
    mode, name, out = sys.argv[1], sys.argv[2], sys.argv[3]
    (save if mode == "save" else load_tp1)(name, out)
'''

RUNS = (("tp2", 2), ("tp2pp2", 4), ("moe", 2))
NO_FORWARD = ("moe",)  # megatron's router calls a Transformer Engine GEMM: no CPU forward for MoE models


def _run(cmd: list[str], **kw) -> None:
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run(cmd, check=True, **kw)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="")
    return env


def venv_dir() -> Path:
    """The tools' venv: `.cache/fixtures/venv-megatron-<pin>-torch-<ver>/`."""
    return CACHE / f"venv-megatron-{MEGATRON or 'latest'}-torch-{TORCH}"


def installed_megatron() -> str:
    """The megatron-core version in the tools' venv, from its dist-info (no import), or '' before it is built."""
    found = sorted(venv_dir().glob("lib/python*/site-packages/megatron_core-*.dist-info"))
    return found[-1].name[len("megatron_core-"):-len(".dist-info")] if found else ""


def build_venv() -> Path:
    """The fixture venv with torch, megatron-core and safetensors; returns its python."""
    where = venv_dir()
    py = where / "bin" / "python"
    if not (where / ".installed").exists():
        venv.create(where, with_pip=True, clear=True)
        spec = f"megatron-core=={MEGATRON}" if MEGATRON else "megatron-core"
        # psutil: megatron's torch_dist writer process needs it, and without it the save waits forever.
        _run([str(py), "-m", "pip", "install", "-q", f"torch=={TORCH}", spec, "safetensors", "numpy", "psutil"])
        (where / ".installed").write_text("ok\n")
    return py


def fixture_root() -> Path:
    """The cache folder for these tool versions (without building anything)."""
    return CACHE / f"megatron-{installed_megatron() or MEGATRON or 'latest'}-torch-{TORCH}-v{FIXTURE_VERSION}"


def build(root: Path) -> Path:
    """Build every run's fixture under root (no-op when done)."""
    if (root / "done").exists():
        return root
    py = build_venv()
    root = fixture_root()  # named after the megatron-core version now installed
    if (root / "done").exists():
        return root
    root.mkdir(parents=True, exist_ok=True)
    (root / "model.py").write_text(MODEL)
    env = _env()
    for port, (name, nproc) in enumerate(RUNS, start=29710):
        out = root / name
        if not (out / "global_reference.safetensors").exists():
            _run([str(py), "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(port),
                  str(root / "model.py"), "save", name, str(out)], env=env, cwd=root)
        if name not in NO_FORWARD:
            _run([str(py), "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", str(port + 10),
                  str(root / "model.py"), "load", name, str(out)], env=env, cwd=root)
    (root / "done").write_text(f"megatron-core {installed_megatron()}\ntorch {TORCH}\n")
    return root


def build_sample(out: Path) -> None:
    """The notebook sample (`sample_checkpoints/training/megatron_tp2pp2/`): a tiny TP=2 x PP=2 Llama-like model saved
    by megatron-core in the legacy layout, model only. Weights are seeded, so a rebuild gives the same tensors."""
    import shutil
    import tempfile

    py = build_venv()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "model.py").write_text(MODEL)
        _run([str(py), "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", "29790",
              str(Path(tmp) / "model.py"), "save", "sample", str(Path(tmp) / "run")], env={**_env(), "WB_MEGATRON_SMALL": "1"}, cwd=tmp)
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(Path(tmp) / "run", out)


def commit(root: Path) -> None:
    """Copy the built runs (not the scripts that made them) to tests/fixtures/megatron/ with the tool versions
    (`done`) and each file's deterministic digest (MANIFEST.json, see scripts/fixture_manifest.py)."""
    import shutil

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from fixture_manifest import write_manifest

    runs = [name for name, _ in RUNS]
    shutil.rmtree(COMMITTED, ignore_errors=True)
    COMMITTED.mkdir(parents=True)
    for name in runs:
        shutil.copytree(root / name, COMMITTED / name)
    shutil.copy(root / "done", COMMITTED / "done")
    tools = dict(line.split(" ", 1) for line in (root / "done").read_text().splitlines() if line.strip())
    write_manifest(COMMITTED, tools, f"scripts/{Path(__file__).name} (fixture version {FIXTURE_VERSION})", runs)
    print(COMMITTED)


def main() -> int:
    if "--sample" in sys.argv:
        build_sample(Path(sys.argv[sys.argv.index("--sample") + 1]))
        return 0
    if "--print-root" in sys.argv:  # the committed runs the tests read
        print(COMMITTED)
        return 0
    root = fixture_root()
    if "--print-built-root" in sys.argv:  # this machine's build (`make fixtures`), which may not exist yet
        print(root)
        return 0
    if "--commit" in sys.argv:  # replace the committed runs with this machine's build
        commit(build(root))
        return 0
    try:
        root = build(root)
    except (subprocess.CalledProcessError, OSError) as exc:
        root.mkdir(parents=True, exist_ok=True)
        (root / "failed").write_text(f"{exc}\n")
        print(f"warning: could not build the Megatron fixtures ({exc}); their tests will be skipped", file=sys.stderr)
        return 0
    print(root)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
