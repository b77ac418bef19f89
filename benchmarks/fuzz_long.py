"""The long fuzz run: the reader fuzz targets of `make test`, with fresh random inputs, for N minutes.

    python benchmarks/fuzz_long.py --minutes 30 [--targets safetensors,dcp-metadata] [--out DIR]

`tests/formats/test_fuzz_readers.py` runs a fixed (derandomized) few hundred inputs per target in about half a
minute; this runs batches of new random inputs round-robin over the targets until the time is up,
checking the same contract (`tests/hostile/fuzzing.py`: only WorkbenchError escapes, nothing outside
the folder is opened, no read past a file's end, bounded bytes read and tracemalloc peak). Every
failing input is shrunk by hypothesis and saved as `DIR/failures/<target>-<digest>.bin` with its
traceback beside it. Prints a table per target; exits 1 when anything failed.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import time
import traceback
import tracemalloc
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

from hostile.fuzzing import apply_mutations, check_reader, mutations  # noqa: E402
from hostile.seeds import TARGETS, build_seed  # noqa: E402
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

BATCH = 100


class TargetRun:
    """One target's seed, counters and failures over the whole run."""

    def __init__(self, name: str, workdir: Path, out: Path) -> None:
        self.name = name
        self.target = TARGETS[name]
        self.folder = workdir / name
        self.path, self.payloads = build_seed(self.target, self.folder)
        self.out = out
        self.examples = self.accepted = self.refused = 0
        self.failures: list[Path] = []

    def batch(self, examples: int) -> None:
        """Run `examples` fresh random inputs; a failure is shrunk, saved, and counted."""
        target, folder, payloads = self.target, self.folder, self.payloads
        last: dict = {}

        @settings(max_examples=examples, deadline=None, database=None, derandomize=False,
                  suppress_health_check=list(HealthCheck), phases=[Phase.generate, Phase.shrink])
        @given(st.data())
        def fuzz(data: st.DataObject) -> None:
            key = data.draw(st.sampled_from(target.payloads))
            mutated = apply_mutations(payloads[key], data.draw(mutations(len(payloads[key]))))
            last.update(key=key, data=mutated)
            target.apply(folder, key, mutated)
            try:
                outcome = check_reader(self.path, folder)
            finally:
                target.apply(folder, key, payloads[key])
            self.examples += 1
            if outcome.accepted:
                self.accepted += 1
            else:
                self.refused += 1

        try:
            fuzz()
        except BaseException as exc:  # noqa: BLE001 - every failure is a finding to save, then go on
            if isinstance(exc, KeyboardInterrupt):
                raise
            self._save(last.get("key", "?"), last.get("data", b""), exc)

    def _save(self, key: str, data: bytes, exc: BaseException) -> None:
        failures = self.out / "failures"
        failures.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256(data).hexdigest()[:12]
        blob = failures / f"{self.name}-{digest}.bin"
        blob.write_bytes(data)
        blob.with_suffix(".txt").write_text(
            f"target {self.name}, payload {key} (write these bytes there, in a copy of the seed, to reproduce)\n\n"
            + "".join(traceback.format_exception(exc)),
            encoding="utf-8",
        )
        self.failures.append(blob)
        print(f"  FAILURE in {self.name} ({type(exc).__name__}): saved {blob}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="how long to run (default 10)")
    parser.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, from: {', '.join(TARGETS)}")
    parser.add_argument("--out", type=Path, default=Path("fuzz-out"), help="where failing inputs are saved (default ./fuzz-out)")
    args = parser.parse_args(argv)
    names = [n for n in args.targets.split(",") if n]
    unknown = sorted(set(names) - set(TARGETS))
    if unknown:
        parser.error(f"unknown targets {unknown}; choose from {', '.join(TARGETS)}")
    deadline = time.monotonic() + args.minutes * 60
    tracemalloc.start()
    with tempfile.TemporaryDirectory(prefix="workbench-fuzz-") as tmp:
        runs = [TargetRun(n, Path(tmp), args.out) for n in names]
        rounds = 0
        while time.monotonic() < deadline:
            for run in runs:
                if time.monotonic() >= deadline:
                    break
                run.batch(BATCH)
            rounds += 1
            print(f"round {rounds}: {sum(r.examples for r in runs)} inputs, {sum(len(r.failures) for r in runs)} failures", flush=True)
    print("\n| target | inputs | read | refused | failures |\n|---|---:|---:|---:|---:|")
    for run in runs:
        print(f"| {run.name} | {run.examples} | {run.accepted} | {run.refused} | {len(run.failures)} |")
    return 1 if any(run.failures for run in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
