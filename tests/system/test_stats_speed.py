"""Value stats and histograms read a tensor at >= 70 % of the speed the engine's bf16 cast reads the same file
(issue 34 item 6): `benchmarks/bench_stats.py` on a 192 MiB tensor, best of three runs each."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_stats.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_stats", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_stats"] = module
    spec.loader.exec_module(module)
    return module


def test_stats_and_histogram_read_at_least_70_percent_of_the_cast_speed(tmp_path):
    speeds = _bench().measure(tmp_path, size_mib=192, repeat=3)
    mib = {what: round(speed / 2**20) for what, speed in speeds.items()}
    assert speeds["stats"] >= 0.7 * speeds["cast"], mib
    assert speeds["histogram"] >= 0.7 * speeds["cast"], mib
