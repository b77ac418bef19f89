"""Long reads in the background: the Explorer's value stats, histograms and value diffs of large tensors run
in a thread with a bar, bytes/ETA text and Cancel; cancel stops within a chunk and leaves the Explorer usable;
results equal the foreground computation."""

from __future__ import annotations

import json
import struct
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import workbench.widgets.background as background_module
from workbench.widgets import Explorer
from workbench.widgets.background import BackgroundTask, ReadCancelled, format_seconds, rate_text
from workbench.widgets.explorer import BACKGROUND_BYTES

BIG = "model.big.weight"
SMALL = "model.small.weight"


def write_safetensors(path: Path, tensors: dict[str, np.ndarray | int]) -> Path:
    """A safetensors file of F32 tensors; an int value stands for a sparse all-zero tensor of that many
    elements (the file is extended without writing its bytes)."""
    header, offset = {}, 0
    for name, value in tensors.items():
        count = value if isinstance(value, int) else value.size
        header[name] = {"dtype": "F32", "shape": [count], "data_offsets": [offset, offset + 4 * count]}
        offset += 4 * count
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(blob)) + blob)
        base = fh.tell()
        for name, value in tensors.items():
            if not isinstance(value, int):
                fh.seek(base + header[name]["data_offsets"][0])
                fh.write(np.ascontiguousarray(value, dtype="<f4").tobytes())
        fh.truncate(base + offset)
    return path


def wait_until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def small_values() -> np.ndarray:
    return np.random.default_rng(0).standard_normal(64).astype(np.float32)


def test_cancel_a_large_stats_read_stops_early_and_leaves_the_explorer_usable(tmp_path, small_values, monkeypatch):
    elements = 50 << 20  # 200 MiB of F32, sparse on disk
    path = write_safetensors(tmp_path / "big.safetensors", {BIG: elements, SMALL: small_values})
    explorer = Explorer(path)
    explorer.select(BIG)
    task = explorer.task
    # The read holds inside its third chunk's hook until Cancel is clicked (a state, not a time): it cannot
    # finish first however fast the disk, and where it stops says how soon the cancel took effect.
    monkeypatch.setattr(background_module, "UPDATE_SECONDS", 0)  # every chunk shows on the bar
    real_hook, clicked, held_at = task._hook, threading.Event(), []

    def hook(nbytes: int) -> None:
        real_hook(nbytes)
        if len(task.updates) == 3 and not held_at:
            held_at.append(task.done_bytes)
            assert clicked.wait(60), "the test never clicked Cancel"

    task._hook = hook
    assert explorer.show_stats() is None  # started in the background: the call returns at once
    assert task.running and task.running_row.layout.display is None and not task.cancel_button.disabled
    wait_until(lambda: held_at)
    assert "Reading value stats of model.big.weight" in task.text.value and "of 200.0 MiB" in task.text.value
    assert task.bar.value > 0
    task.cancel_button.click()
    clicked.set()
    with pytest.raises(ReadCancelled, match="cancelled after"):
        task.wait(timeout=60)
    assert task.done_bytes == held_at[0]  # stopped at the very next chunk: not one more byte read
    assert task.state == "cancelled" and task.done_bytes < 4 * elements
    assert "Cancelled reading value stats" in task.text.value and task.running_row.layout.display == "none"
    assert explorer.stats_view.value == "" and BIG not in explorer._stats_cache
    explorer.select(SMALL)  # the explorer still answers: a small read runs at once, in the foreground
    stats = explorer.show_stats()
    assert stats is not None and stats.loc[SMALL, "max"] == pytest.approx(float(small_values.max()))
    assert f"{float(small_values.min()):.6g}" in explorer.stats_view.value


def test_background_stats_report_growing_progress_and_equal_the_foreground(tmp_path):
    values = np.random.default_rng(1).standard_normal((BACKGROUND_BYTES // 4) + 12345).astype(np.float32)
    values[7] = np.nan
    path = write_safetensors(tmp_path / "mid.safetensors", {BIG: values})
    background = Explorer(path)
    background.select(BIG)
    assert background.show_stats() is None
    result = background.task.wait(timeout=120)
    task = background.task
    assert task.state == "done" and task.done_bytes == values.nbytes
    assert task.updates == sorted(task.updates) and len(set(task.updates)) == len(task.updates)
    assert "Read 32.0 MiB" in task.text.value
    foreground = Explorer(path)
    foreground.select(BIG)
    expected = foreground.show_stats(background=False)
    assert result.equals(expected) and background._stats_cache[BIG].equals(expected)
    assert background.stats_view.value == foreground.stats_view.value
    assert expected.loc[BIG, "nan"] == 1
    assert expected.loc[BIG, "mean"] == pytest.approx(float(np.nanmean(values.astype(np.float64))), abs=1e-9)


def test_histogram_in_the_background_shows_the_figure(tmp_path, small_values):
    path = write_safetensors(tmp_path / "h.safetensors", {SMALL: small_values})
    explorer = Explorer(path)
    explorer.select(SMALL)
    assert explorer.show_histogram(background=True) is None
    explorer.task.wait(timeout=60)
    (shown,) = explorer.histogram_output.outputs
    assert "image/png" in shown["data"]
    assert explorer.task.done_bytes == 2 * small_values.nbytes  # range pass, then counts


def test_reads_over_the_threshold_wait_for_confirmation(tmp_path, small_values):
    path = write_safetensors(tmp_path / "c.safetensors", {BIG: 16 << 20, SMALL: small_values})
    explorer = Explorer(path)
    explorer.task.confirm_above = 32 << 20  # stands for the 1 GiB default
    explorer.select(BIG)
    explorer.show_stats()
    task = explorer.task
    assert task.state == "confirm" and task.done_bytes == 0 and task.confirm_row.layout.display is None
    assert "reads 64.0 MiB from disk" in task.text.value
    task.dismiss_button.click()
    assert task.state == "idle" and task.text.value == ""
    explorer.show_stats()
    task.confirm_button.click()
    stats = task.wait(timeout=120)
    assert stats.loc[BIG, "max"] == 0.0 and "0" in explorer.stats_view.value


def test_value_diff_in_the_background_fills_the_compare_tab(tmp_path, small_values):
    rng = np.random.default_rng(2)
    big = rng.standard_normal((BACKGROUND_BYTES // 8) + 1).astype(np.float32)
    changed = big.copy()
    changed[-1] += 0.25
    a = write_safetensors(tmp_path / "a.safetensors", {BIG: big, SMALL: small_values})
    b = write_safetensors(tmp_path / "b.safetensors", {BIG: changed, SMALL: small_values})
    explorer = Explorer(a, compare=b)
    assert "no differences" in explorer.diff_summary.value
    explorer.values_button.click()
    assert explorer.diff_task.running or explorer.diff_task.state == "done"
    explorer.diff_task.wait(timeout=120)
    assert "1 values changed" in explorer.diff_summary.value and "(values compared)" in explorer.diff_summary.value
    assert explorer.diff_task.done_bytes == 2 * (big.nbytes + small_values.nbytes)
    assert explorer.diff(values=True).loc[BIG, "max_abs_diff"] == pytest.approx(0.25, rel=1e-6)


def test_a_failed_read_is_shown_and_raised_by_wait():
    task = BackgroundTask()

    def broken(on_read):
        on_read(10)
        raise ValueError("disk on fire")

    errors = []
    assert task.run(broken, total_bytes=100, what="x", on_error=errors.append)
    with pytest.raises(ValueError, match="disk on fire"):
        task.wait(timeout=10)
    assert task.state == "failed" and "disk on fire" in task.text.value and len(errors) == 1
    assert task.run(lambda on_read: 42, total_bytes=0, what="y") and task.wait(timeout=10) == 42


def test_rate_text_and_durations():
    assert rate_text(0, 100, 0.0) == "0 B of 100 B (0%)"
    text = rate_text(1 << 30, 4 << 30, 10.0)
    assert "1.0 GiB of 4.0 GiB (25%)" in text and "102.4 MiB/s" in text and "about 30 s left" in text
    assert format_seconds(0.42) == "0.4 s" and format_seconds(185) == "3 min 05 s" and format_seconds(3720) == "1 h 02 min"


def test_verify_checks_structure_and_rehashes_against_a_sidecar_in_the_background(tmp_path, small_values):
    from workbench.explore.verify import verify

    big = np.random.default_rng(3).standard_normal((BACKGROUND_BYTES // 4) + 1).astype(np.float32)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    path = write_safetensors(folder / "model.safetensors", {BIG: big, SMALL: small_values})
    explorer = Explorer(folder)
    report = explorer.verify()  # no sidecar: headers and sizes only, at once, nothing written
    assert report.ok and "OK" in explorer.verify_view.value and "No checksum sidecar" in explorer.verify_view.value
    assert not (folder / "checksums.sha256.json").exists()
    assert verify(folder, checksums=True).checksums.action == "recorded"
    explorer.verify_button.click()  # a sidecar now: every tensor is re-hashed in the background
    checked = explorer.verify_task.wait(timeout=120)
    assert checked.ok and checked.checksums.action == "checked" and "OK" in explorer.verify_view.value
    assert explorer.verify_task.done_bytes == big.nbytes + small_values.nbytes
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40  # the last byte of SMALL
    path.write_bytes(bytes(data))
    explorer.verify(background=False)
    assert "does not match its recorded checksum" in explorer.verify_view.value and "wb-error" in explorer.verify_view.value


@pytest.mark.parametrize("ending", ["done", "cancelled", "failed"])
def test_value_stats_and_histogram_are_disabled_while_a_read_runs(tmp_path, small_values, ending):
    path = write_safetensors(tmp_path / "d.safetensors", {SMALL: small_values})
    explorer = Explorer(path)
    explorer.select(SMALL)
    buttons = (explorer.stats_button, explorer.histogram_button)
    assert not any(b.disabled for b in buttons)
    started, release = threading.Event(), threading.Event()
    real_stats = explorer.checkpoint.stats

    def held_stats(name, *, chunk_elements, on_read):  # the read waits until the test lets it go on
        started.set()
        release.wait(30)
        if ending == "failed":
            raise wb_error("Cannot read tensor: the disk went away (test).")
        on_read(0)  # the cancelled read stops at its next chunk
        return real_stats(name, chunk_elements=chunk_elements, on_read=on_read)

    explorer.checkpoint.stats = held_stats
    assert explorer.show_stats(background=True) is None  # as the button does for a large tensor
    assert started.wait(30)
    assert all(b.disabled for b in buttons)  # one read at a time
    explorer.histogram_button.click()  # a click on a disabled button (as a script can do) starts nothing
    assert explorer.task.what == f"value stats of {SMALL}"
    if ending == "cancelled":
        explorer.task.cancel_button.click()
        assert all(b.disabled for b in buttons)  # still unwinding
    release.set()
    wait_until(lambda: not explorer.task.running)
    assert explorer.task.state == ending
    assert not any(b.disabled for b in buttons)


def wb_error(message: str) -> Exception:
    from workbench.errors import CheckpointError

    return CheckpointError(message)


def test_a_histogram_after_value_stats_reads_the_tensor_once(tmp_path, small_values):
    path = write_safetensors(tmp_path / "o.safetensors", {SMALL: small_values})
    explorer = Explorer(path)
    explorer.select(SMALL)
    explorer.show_stats(background=True)
    explorer.task.wait(timeout=60)
    explorer.show_histogram(background=True)
    explorer.task.wait(timeout=60)
    assert explorer.task.done_bytes == small_values.nbytes  # the stats' min and max were the range
    (shown,) = explorer.histogram_output.outputs
    assert "image/png" in shown["data"]
