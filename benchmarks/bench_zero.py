"""Peak RSS and time of turning a DeepSpeed ZeRO checkpoint into fp32 safetensors: workbench vs zero_to_fp32.

    python benchmarks/bench_zero.py RUN_FOLDER [--workdir DIR]

RUN_FOLDER is a DeepSpeed run folder (with `latest`), e.g. one built by
`WB_ZERO_HIDDEN=1024 WB_ZERO_LAYERS=8 WB_ZERO_STAGES=3 python scripts/make_deepspeed_fixtures.py`.
Each contender runs in a fresh child process; peak RSS is the child's ru_maxrss (os.wait4), time is wall
clock. DeepSpeed's `convert_zero_checkpoint_to_fp32_state_dict` runs in the fixture venv (deepspeed is
not in the project venv), the workbench in this interpreter. Both outputs are compared tensor by tensor.
Prints one markdown table.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

# DeepSpeed's own convert_zero_checkpoint_to_fp32_state_dict(safe_serialization=True) refuses tied weights
# (safetensors' shared-memory check), so the state dict is saved the way the fixtures' reference is: ties cloned.
ZERO_TO_FP32 = """
import os, sys
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from safetensors.torch import save_file
sd = get_fp32_state_dict_from_zero_checkpoint(sys.argv[1])
seen, out = set(), {}
for k, v in sd.items():
    v = v.contiguous()
    out[k] = v.clone() if v.data_ptr() in seen else v
    seen.add(v.data_ptr())
os.makedirs(sys.argv[2], exist_ok=True)
save_file(out, os.path.join(sys.argv[2], "model.safetensors"))
"""
WORKBENCH = """
import sys
import workbench as wb
wb.convert(sys.argv[1], sys.argv[2], quiet=True)
"""


def run_child(cmd: list[str], env: dict[str, str]) -> tuple[float, int]:
    """(seconds, peak RSS bytes) of one child process."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - start
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{cmd[0]} failed:\n{err[-2000:]}")
    return elapsed, usage.ru_maxrss * 1024


def same_output(a: Path, b: Path) -> bool:
    import torch
    from safetensors import safe_open

    def tensors(folder: Path) -> dict[str, Path]:
        out = {}
        for f in folder.glob("*.safetensors"):
            with safe_open(str(f), "pt") as fh:
                out.update({k: f for k in fh.keys()})  # noqa: SIM118 (safe_open is not iterable)
        return out

    ta, tb = tensors(a), tensors(b)
    if set(ta) != set(tb):
        return False
    for name in ta:
        with safe_open(str(ta[name]), "pt") as fa, safe_open(str(tb[name]), "pt") as fb:
            if not torch.equal(fa.get_tensor(name), fb.get_tensor(name)):
                return False
    return True


def main() -> None:
    import make_deepspeed_fixtures as fixtures

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    run = Path(args.run)
    step = run / (run / "latest").read_text().strip()
    optim_bytes = sum(f.stat().st_size for f in step.glob("*optim_states.pt"))
    all_bytes = sum(f.stat().st_size for f in step.iterdir())
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_zero_"))
    ds_python = fixtures.venv_dir() / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    wb_env = dict(os.environ, PYTHONPATH=str(REPO))

    import workbench as wb

    plan = wb.plan(run, None)
    rows = []
    t, rss = run_child([str(ds_python), "-c", ZERO_TO_FP32, str(run), str(work / "zero_to_fp32")], env)
    rows.append(("DeepSpeed zero_to_fp32 (safetensors)", t, rss, None))
    t, rss = run_child([sys.executable, "-c", WORKBENCH, str(run), str(work / "workbench")], wb_env)
    rows.append(("workbench convert", t, rss, plan.peak_bytes))
    equal = same_output(work / "zero_to_fp32", work / "workbench")
    mib = 1 << 20
    stage = plan.source.metadata.get("zero_stage")
    print(f"checkpoint: {step} (ZeRO stage {stage}, "
          f"{len(list(step.glob('*optim_states.pt')))} ranks, {optim_bytes / mib:.0f} MiB optimizer files, "
          f"{all_bytes / mib:.0f} MiB total; fp32 weights {plan.source.total_bytes / mib:.0f} MiB)\n")
    print("| tool | time (s) | peak RSS (MiB) | predicted tensor peak (MiB) |")
    print("|---|---:|---:|---:|")
    for name, t, rss, pred in rows:
        print(f"| {name} | {t:.2f} | {rss / mib:.0f} | {'' if pred is None else f'{pred / mib:.1f}'} |")
    print(f"\noutputs identical: {equal}")


if __name__ == "__main__":
    main()
