"""Issue 29 D18, the launcher's leftovers: the run report's rank balance when a rank idles, the lock
message after the launcher was killed (it names the live workers that hold the lock), and the
`workbench-job-*` folders of dead launchers (removed by the next launch)."""

from __future__ import annotations

from pathlib import Path

from workbench.engine.report import RankResult, RunReport


def report(*ranks: tuple[int, float]) -> RunReport:
    results = [RankResult(rank=i, bytes_written=written, seconds=seconds) for i, (written, seconds) in enumerate(ranks)]
    return RunReport(dest=Path("out"), ranks=results, seconds=1.0, predicted_peak_bytes=0, predicted_files=[],
                     predicted_bytes_read=0, predicted_bytes_written=0, files=[], launcher="local")


def test_an_idle_rank_is_named_not_an_infinite_ratio() -> None:
    line = report((1000, 2.0), (0, 0.1)).summary()
    assert "inf" not in line
    assert "rank balance: rank 1 of 2 wrote nothing" in line and "smaller --nproc" in line
    line = report((1000, 2.0), (500, 1.0), (0, 0.1), (0, 0.1)).summary()
    assert "ranks 2, 3 of 4 wrote nothing" in line and "among the others (largest / smallest): bytes written 2.00x, seconds 2.00x" in line
    assert "rank balance (largest / smallest rank): bytes written 1.25x, seconds 1.50x" in report((1000, 3.0), (800, 2.0)).summary()
    assert "inf" not in report((1000, 0.0), (800, 0.0)).summary()
