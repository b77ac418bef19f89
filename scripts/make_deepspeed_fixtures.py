"""Build real DeepSpeed ZeRO 1/2/3 checkpoints (and zero_to_fp32's reference) in a cache folder.

DeepSpeed must not sit in the project venv (once installed, importing transformers imports it), so
this script creates its own venv under `.cache/fixtures/deepspeed-<ver>-torch-<ver>/venv`, installs
torch + deepspeed (DS_BUILD_OPS=0) + transformers there, and trains a tiny transformers Llama with
`torchrun --nproc-per-node 2` on gloo (DS_ACCELERATOR=cpu, bf16) for two steps per ZeRO stage (and on 3 ranks,
`stage<N>-w3/`, for stages 1 and 2, and on 2 ranks with an odd parameter count, `stage2-odd/`: DeepSpeed saves
their last partition shorter).
Each `stage<N>/` holds the run folder (`latest`, `global_step2/`), `reference.safetensors` (the state
dict DeepSpeed's own `get_fp32_state_dict_from_zero_checkpoint` returns) and `live_reference.safetensors`
(what DeepSpeed's `safe_get_full_fp32_param` / `safe_get_full_optimizer_state` gathered from the live
engine: fp32 masters and Adam moments by parameter name). Re-running is a no-op
when the `done` marker exists and every run is built. Usage: python scripts/make_deepspeed_fixtures.py
[--print-root (the committed copy the tests read: tests/fixtures/deepspeed) | --print-built-root (this build)
| --commit (build, then replace the committed copy and its MANIFEST.json)]

`--sample DIR` instead trains the notebook's tiny ZeRO-3 run (hidden 16, one layer, bf16, 2 ranks) and writes
the run folder (`latest`, `global_step2/`, config.json; not the zero_to_fp32.py DeepSpeed drops beside it) to
DIR, with DeepSpeed's own `get_fp32_state_dict_from_zero_checkpoint` output next to it as
`DIR_expected.safetensors` (`sample_checkpoints/training/zero3_tiny`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

TORCH = "2.13.0"
DEEPSPEED = os.environ.get("WB_DEEPSPEED_VERSION", "")  # empty: what the resolver picks, recorded after install
REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache" / "fixtures"
COMMITTED = REPO / "tests" / "fixtures" / "deepspeed"  # what the tests read: a copy of one build, see --commit
STAGES = tuple(int(s) for s in os.environ.get("WB_ZERO_STAGES", "1,2,3").split(","))
# fp16 runs (loss scaler, fp16 module weights) for these stages too; bf16 for every stage in STAGES.
FP16_STAGES = tuple(int(s) for s in os.environ.get("WB_ZERO_FP16_STAGES", "2").split(",") if s)
# bf16 runs on 3 ranks for these stages too (`stage<N>-w3`): the group's flat buffer (27,712 elements) is not a multiple of
# 2 * 3, so DeepSpeed saves the last rank's partition shorter (it strips the alignment padding).
WIDE_STAGES = tuple(int(s) for s in os.environ.get("WB_ZERO_WIDE_STAGES", "1,2").split(",") if s)
# bf16 runs on 2 ranks of a model with one more parameter of 3 elements (`stage<N>-odd`): an odd count, so the
# last partition is 1 element shorter.
ODD_STAGES = tuple(int(s) for s in os.environ.get("WB_ZERO_ODD_STAGES", "2").split(",") if s)
HIDDEN = int(os.environ.get("WB_ZERO_HIDDEN", "32"))
LAYERS = int(os.environ.get("WB_ZERO_LAYERS", "2"))

TRAIN = r'''
import json, os, sys
import torch, deepspeed
from transformers import LlamaConfig, LlamaForCausalLM
stage, out, hidden, layers, dtype = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
odd = sys.argv[6:] == ["odd"]  # one more trainable parameter of 3 elements: an odd parameter count
if dtype == "fp16":
    # DeepSpeed's CPU accelerator refuses fp16 when oneDNN lacks fp16 kernels; that is a check of this CPU's speed,
    # not of the file format: torch computes fp16 on any CPU, and the checkpoint is what a GPU run writes.
    from deepspeed.accelerator import get_accelerator
    type(get_accelerator()).is_fp16_supported = lambda self: True
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=250, hidden_size=hidden, intermediate_size=2 * hidden + 6, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
model = LlamaForCausalLM(cfg)
# A frozen parameter: ZeRO keeps it out of the optimizer and saves it in the module states.
model.model.layers[0].input_layernorm.weight.requires_grad_(False)
if odd:
    model.register_parameter("odd_scale", torch.nn.Parameter(torch.randn(3)))
params = [p for p in model.parameters() if p.requires_grad]
opt = torch.optim.AdamW(params, lr=1e-2)
precision = {"fp16": {"enabled": True, "initial_scale_power": 8}} if dtype == "fp16" else {"bf16": {"enabled": True}}
ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, **precision,
      "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True, "steps_per_print": 1000}
engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds)
g = torch.Generator().manual_seed(1 + engine.global_rank)
for _ in range(2):
    ids = torch.randint(0, 250, (2, 16), generator=g)
    loss = engine(input_ids=ids, labels=ids).loss
    if odd:
        loss = loss + 1e-3 * engine.module.odd_scale.square().sum()
    engine.backward(loss)
    engine.step()
engine.save_checkpoint(out)
# DeepSpeed's own gather of every parameter's fp32 master and Adam moments (collective: all ranks call it).
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
live = {}
for name, p in engine.module.named_parameters():
    if p.requires_grad:
        live[name] = safe_get_full_fp32_param(p).detach().clone()
        for state in ("exp_avg", "exp_avg_sq"):
            live[f"optimizer.state.{name}.{state}"] = safe_get_full_optimizer_state(p, state).detach().clone()
if engine.global_rank == 0:
    cfg.save_pretrained(out)
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in live.items()}, os.path.join(out, "live_reference.safetensors"))
'''

REFERENCE = r'''
import sys, torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from safetensors.torch import save_file
sd = get_fp32_state_dict_from_zero_checkpoint(sys.argv[1])
# Tied weights come back as one tensor under two names; safetensors wants each storage once.
seen, out = {}, {}
for k, v in sd.items():
    out[k] = v.clone() if v.data_ptr() in seen else v.contiguous()
    seen[v.data_ptr()] = k
save_file(out, sys.argv[2])
'''


def _run(cmd: list[str], **kw) -> None:
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run(cmd, check=True, **kw)


def _run_twice(commands: list[list[str]], **kw) -> subprocess.CalledProcessError | None:
    """Run the commands in order, a second time if one fails: gloo can abort a rank at interpreter exit
    after the work is done (see the README's model I/O section), which is not a DeepSpeed failure."""
    for attempt in range(2):
        try:
            for command in commands:
                _run(command, **kw)
            return None
        except subprocess.CalledProcessError as exc:
            if attempt == 1:
                return exc
    return None


def _env(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env.update(DS_BUILD_OPS="0", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               TORCH_EXTENSIONS_DIR=str(venv_dir() / "torch_extensions"), MASTER_ADDR="127.0.0.1")
    return env


def venv_dir() -> Path:
    """The tools' venv, shared by every fixture size: `.cache/fixtures/venv-deepspeed-<pin>-torch-<ver>/`."""
    return CACHE / f"venv-deepspeed-{DEEPSPEED or 'latest'}-torch-{TORCH}"


def installed_deepspeed() -> str:
    """The deepspeed version in the tools' venv, from its dist-info (no import), or '' before it is built."""
    found = sorted(venv_dir().glob("lib/python*/site-packages/deepspeed-*.dist-info"))
    return found[-1].name[len("deepspeed-"):-len(".dist-info")] if found else ""


def build_venv(root: Path) -> Path:
    """The fixture venv with torch, deepspeed and transformers; returns its python."""
    where = venv_dir()
    py = where / "bin" / "python"
    if not (where / ".installed").exists():
        venv.create(where, with_pip=True, clear=True)
        _run([str(py), "-m", "pip", "install", "-q", f"torch=={TORCH}"])
        spec = f"deepspeed=={DEEPSPEED}" if DEEPSPEED else "deepspeed"
        _run([str(py), "-m", "pip", "install", "-q", spec, "transformers", "safetensors"], env=_env(root))
        (where / ".installed").write_text("ok\n")
    return py


FIXTURE_VERSION = 3  # bump when what the fixtures hold changes


def fixture_root() -> Path:
    """The cache folder for these tool versions and model sizes (without building anything)."""
    ds = installed_deepspeed() or DEEPSPEED or "latest"
    fp16 = f"-f{''.join(map(str, FP16_STAGES))}" if FP16_STAGES else ""
    return CACHE / f"deepspeed-{ds}-torch-{TORCH}-h{HIDDEN}-l{LAYERS}-s{''.join(map(str, STAGES))}{fp16}-v{FIXTURE_VERSION}"


def _runs() -> list[tuple[int, str, int, str]]:
    """(stage, dtype, ranks, folder name) of every run the fixture set holds."""
    runs = [(stage, "bf16", 2, f"stage{stage}") for stage in STAGES]
    runs += [(stage, "fp16", 2, f"stage{stage}-fp16") for stage in FP16_STAGES]
    runs += [(stage, "bf16", 2, f"stage{stage}-odd") for stage in ODD_STAGES]
    return runs + [(stage, "bf16", 3, f"stage{stage}-w3") for stage in WIDE_STAGES]


def _complete(root: Path) -> bool:
    """True when every run is built (or recorded as failed): runs added to the set later are built on the next call."""
    return (root / "done").exists() and all(
        (root / name / "reference.safetensors").exists() or (root / name / "failed").exists() for *_, name in _runs())


def build(root: Path) -> Path:
    """Build every stage's fixture under root (no-op when done)."""
    if _complete(root):
        return root
    py = build_venv(root)
    root = fixture_root()  # named after the deepspeed version now installed
    if _complete(root):
        return root
    root.mkdir(parents=True, exist_ok=True)
    env = _env(root)
    (root / "train.py").write_text(TRAIN)
    (root / "reference.py").write_text(REFERENCE)
    for stage, dtype, ranks, name in _runs():
        out = root / name
        if (out / "reference.safetensors").exists():
            continue
        odd = name.endswith("-odd")
        port = str(29600 + stage + (10 if dtype == "fp16" else 0) + (20 if ranks != 2 else 0) + (30 if odd else 0))
        train = [str(py), "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port", port,
                 str(root / "train.py"), str(stage), str(out), str(HIDDEN), str(LAYERS), dtype, *(["odd"] if odd else [])]
        reference = [str(py), str(root / "reference.py"), str(out), str(out / "reference.safetensors")]
        error = _run_twice([train, reference], env=env, cwd=root)
        if error is not None:  # this run's tests skip with the reason; the other runs stay usable
            out.mkdir(parents=True, exist_ok=True)
            (out / "failed").write_text(f"{error}\n")
            print(f"warning: DeepSpeed run {name} failed twice ({error}); its tests will be skipped", file=sys.stderr)
    version = subprocess.run([str(py), "-c", "import deepspeed; print(deepspeed.__version__)"], env=env,
                             capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    (root / "done").write_text(f"deepspeed {version}\ntorch {TORCH}\n")
    return root


def build_sample(dest: Path) -> None:
    """Train the notebook's tiny ZeRO-3 run with DeepSpeed and copy the run folder and its reference to `dest`."""
    import shutil
    import tempfile

    py = build_venv(fixture_root())
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "train.py").write_text(TRAIN)
        (work / "reference.py").write_text(REFERENCE)
        run = work / "run"
        env = _env(work)
        _run([str(py), "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29631",
              str(work / "train.py"), "3", str(run), "16", "1", "bf16"], env=env, cwd=work)
        _run([str(py), str(work / "reference.py"), str(run), str(work / "expected.safetensors")], env=env, cwd=work)
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        tag = (run / "latest").read_text().strip()
        for name in ("latest", "config.json"):
            shutil.copy(run / name, dest / name)
        shutil.copytree(run / tag, dest / tag)
        shutil.copy(work / "expected.safetensors", dest.parent / f"{dest.name}_expected.safetensors")


def commit(root: Path) -> None:
    """Copy the built runs (not the scripts that made them) to tests/fixtures/deepspeed/ with the tool versions
    (`done`) and each file's deterministic digest (MANIFEST.json, see scripts/fixture_manifest.py)."""
    import shutil

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from fixture_manifest import write_manifest

    runs = [name for *_, name in _runs()]
    shutil.rmtree(COMMITTED, ignore_errors=True)
    COMMITTED.mkdir(parents=True)
    for name in runs:  # not the zero_to_*.py scripts DeepSpeed drops beside a run: its code, not the run's data
        shutil.copytree(root / name, COMMITTED / name, ignore=shutil.ignore_patterns("zero_to_*.py"))
    shutil.copy(root / "done", COMMITTED / "done")
    tools = dict(line.split(" ", 1) for line in (root / "done").read_text().splitlines() if line.strip())
    write_manifest(COMMITTED, tools, f"scripts/{Path(__file__).name} (fixture version {FIXTURE_VERSION})", runs)
    print(COMMITTED)


def main() -> int:
    if "--sample" in sys.argv:
        build_sample(Path(sys.argv[sys.argv.index("--sample") + 1]).resolve())
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
        print(f"warning: could not build the DeepSpeed fixtures ({exc}); their tests will be skipped", file=sys.stderr)
        return 0
    print(root)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
