"""Casts never bless a wrong output: non-float dtype policies are refused, overflow is counted and can fail a run.

A dtype policy (`dtype=` / `--dtype`) stores floating-point weights in another floating-point dtype the engine
can produce; anything else (ints, bool, complex, F4/F6, the unsigned F8_E8M0 scale format) is refused before
anything is written. Values a cast cannot represent (fp16 -> inf, float8 e4m3 -> ±448, fnuz -> NaN, ints wrap)
are counted per tensor in every cast path, reported, and `on_overflow="error"` fails the run before the index.
"""

from __future__ import annotations

import json
import os
import struct
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import workbench as wb
from tests.conftest import load_safetensors_folder
from workbench import mapper as M
from workbench import overflow
from workbench.cli import main
from workbench.dtypes import normalize_dtype, to_torch
from workbench.engine import bf16, cast_buffers
from workbench.errors import CastOverflowError, MapperError, PlanError
from workbench.formats import open_catalog

INDEX = "model.safetensors.index.json"


# --- A2: a dtype policy is float-only --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["int8", "bool", "I64", "U8", "C64", "uint16", "F4", "F6_E2M3", "F6_E3M2", "F8_E8M0"])
def test_a_dtype_policy_refuses_targets_that_are_not_producible_floats(tiny_checkpoint, tmp_path: Path, dtype: str) -> None:
    source = tiny_checkpoint()
    dest = tmp_path / "out"
    with pytest.raises(PlanError, match=r"Cannot store the weights as .*BF16.*F16.*F32") as caught:
        wb.plan(source, dtype=dtype, dest=dest)
    non_float = normalize_dtype(dtype) not in ("F4", "F6_E2M3", "F6_E3M2", "F8_E8M0")
    assert ("M.Cast" in caught.value.message) == non_float  # where an explicit integer cast belongs
    with pytest.raises(PlanError, match="Cannot store the weights as"):
        wb.convert(source, dest, dtype=dtype, quiet=True)
    assert not dest.exists()


def test_cli_refuses_an_integer_dtype_before_writing(tiny_checkpoint, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    dest = tmp_path / "out"
    assert main(["convert", str(tiny_checkpoint()), str(dest), "--dtype", "int8", "--verify", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("workbench convert: Cannot store the weights as int8 (I8)") and "bf16" in err
    assert not dest.exists()


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "F32", "F64", "fp8", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ"])
def test_a_dtype_policy_casts_floats_only_and_bit_for_bit(tiny_checkpoint, tmp_path: Path, dtype: str) -> None:
    tensors = {"w": torch.randn(8, 4), "h": torch.randn(4).to(torch.float16), "ids": torch.arange(6),
               "mask": torch.tensor([True, False]), "bytes": torch.arange(5, dtype=torch.uint8)}
    source = tiny_checkpoint(tensors)
    report = wb.convert(source, tmp_path / "out", dtype=dtype, quiet=True, verify=True)
    got = load_safetensors_folder(tmp_path / "out")
    target = to_torch(normalize_dtype(dtype))
    for name in ("w", "h"):
        assert got[name].dtype == target and torch.equal(got[name].view(torch.uint8), tensors[name].to(target).view(torch.uint8))
    for name in ("ids", "mask", "bytes"):  # int and bool buffers are never cast
        assert got[name].dtype == tensors[name].dtype and torch.equal(got[name], tensors[name])
    assert report.verified


def _raw_safetensors(path: Path, entries: dict[str, tuple[str, list[int], bytes]]) -> None:
    header, data = {}, b""
    for name, (dtype, shape, raw) in entries.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def test_a_dtype_policy_keeps_f4_sources_it_cannot_read_and_says_so(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    _raw_safetensors(source / "model.safetensors", {"packed": ("F4", [8], bytes(range(4))),
                                                    "w": ("F32", [2], np.array([1.5, -2.0], np.float32).tobytes())})
    plan = wb.plan(source, dtype="bf16")
    assert plan.ok
    assert any(p.severity == "warning" and "F4" in p.message and "packed" in p.message for p in plan.problems)
    wb.convert(source, tmp_path / "out", dtype="bf16", quiet=True)
    out = open_catalog(tmp_path / "out")
    assert out["packed"].dtype == "F4" and out["w"].dtype == "BF16"
    assert out.read_bytes("packed") == bytes(range(4))
    refused = wb.plan(source, M.Cast("packed", "bf16"))  # an explicit cast from F4 is refused at plan time too
    assert not refused.ok and any("cannot read" in p.message and "F4" in p.message for p in refused.errors)


def test_explicit_casts_may_target_ints_but_not_dtypes_the_engine_cannot_produce(tiny_checkpoint, tmp_path: Path) -> None:
    tensors = {"mask": torch.tensor([0.0, 1.0, 1.0, 0.0]), "w": torch.randn(3)}
    source = tiny_checkpoint(tensors)
    report = wb.convert(source, tmp_path / "out", M.Cast("mask", "bool"), quiet=True, verify=True)
    assert load_safetensors_folder(tmp_path / "out")["mask"].tolist() == [False, True, True, False] and report.verified
    for code in ("F4", "F6_E2M3"):
        with pytest.raises(MapperError, match=f"Cannot build Cast of 'w': the engine cannot produce {code}"):
            M.Cast("w", code)


# --- A3: overflow is counted, reported, and can fail the run ----------------------------------------------------


def test_overflow_thresholds_match_torch_rounding() -> None:
    """Just below the threshold a value rounds into range; at the threshold it overflows (inf, saturation or NaN)."""
    for code in ("F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ"):
        target = to_torch(code)
        high = overflow.limits(code)[1]
        finite_max = torch.finfo(target).max
        below = torch.tensor([np.nextafter(np.float32(high), np.float32(0))], dtype=torch.float32)
        at = torch.tensor([high], dtype=torch.float32)
        assert below.to(target).float().item() == finite_max, code
        assert at.to(target).float().item() != pytest.approx(float(at)), code  # not a rounding: a replacement
        assert overflow.count_torch(torch.cat([below, at, -at]), "F32", code)[0] == 2, code
    assert overflow.count_torch(torch.tensor([127.9, 128.0, -128.9, -129.0]), "F32", "I8")[0] == 2
    assert overflow.count_torch(torch.tensor([300, -1, 5], dtype=torch.int16), "I16", "U8")[0] == 2
    assert not overflow.may_overflow("BF16", "F32") and not overflow.may_overflow("F16", "BF16")
    assert overflow.may_overflow("F32", "BF16") and overflow.may_overflow("U16", "F16")


def _overflow_source(tiny_checkpoint, big: float, **kwargs) -> Path:
    gen = torch.Generator().manual_seed(0)
    hot = torch.randn(4000, generator=gen)
    hot[[10, 3000]] = torch.tensor([big, -big])
    hot[20] = float("inf")  # already infinite: not an overflow where the target has inf
    warm = torch.randn(300, generator=gen)
    warm[5] = big
    return tiny_checkpoint({"hot.weight": hot, "warm.weight": warm, "cool.weight": torch.randn(50, generator=gen)}, **kwargs)


@pytest.mark.parametrize(("dtype", "big", "numpy_first"), [
    ("fp16", 70000.0, False),          # torch chunked cast: becomes inf
    ("bf16", 3.4e38, True),            # numpy fast path: rounds to inf
    ("bf16", 3.4e38, False),           # the same cast by torch
    ("fp8", 1000.0, False),            # e4m3: saturates to ±448
])
def test_cast_overflow_is_counted_reported_and_verified(tiny_checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        dtype: str, big: float, numpy_first: bool) -> None:
    monkeypatch.setattr(cast_buffers, "PREFER_TORCH_ONCE_IMPORTED", not numpy_first)
    used = []
    convert = bf16.Float32ToBFloat16.convert_file
    monkeypatch.setattr(bf16.Float32ToBFloat16, "convert_file", lambda self, *a: used.append(1) or convert(self, *a))
    source = _overflow_source(tiny_checkpoint, big)
    with pytest.warns(wb.CastOverflowWarning, match="overflow"):
        report = wb.convert(source, tmp_path / "out", dtype=dtype, chunk_size="4KB", quiet=True, verify=True)
    assert bool(used) == numpy_first
    code = normalize_dtype(dtype)
    extra = 1 if code == "F8_E4M3" else 0  # e4m3 has no inf: the infinite input saturates too
    assert report.overflow == {"hot.weight": (2 + extra, pytest.approx(float("inf") if extra else big, rel=1e-6)),
                               "warm.weight": (1, pytest.approx(big, rel=1e-6))}
    assert report.overflow_values == 3 + extra
    summary = report.summary()
    warning = next(line for line in summary.splitlines() if line.startswith("warning: overflow"))
    assert "hot.weight" in warning and "warm.weight" in warning and code in warning
    frame = report.verification
    assert frame.loc["hot.weight", "overflow"] == 2 + extra and frame.loc["cool.weight", "overflow"] == 0
    assert frame.loc["cool.weight", "status"] == "ok" and report.verified  # the output is the cast, as planned
    assert "largest absolute difference" in summary and "overflowed" in summary
    assert frame.loc["hot.weight", "max_abs_diff"] >= big - float(torch.finfo(to_torch(code)).max)


def test_no_overflow_no_warning(tiny_checkpoint, tmp_path: Path) -> None:
    source = tiny_checkpoint({"w": torch.randn(100)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = wb.convert(source, tmp_path / "out", dtype="fp16", quiet=True, verify=True)
    assert report.overflow == {} and report.overflow_warning is None and report.overflow_values == 0
    assert "warning: overflow" not in report.summary() and "overflowed their dtype" not in report.summary()
    assert (report.verification["overflow"] == 0).all()


def test_overflow_in_compute_steps_and_explicit_casts_is_counted(tiny_checkpoint, tmp_path: Path) -> None:
    source = tiny_checkpoint({"a.weight": torch.tensor([[70000.0, 1.0], [2.0, 3.0]]), "b.weight": torch.tensor([1e6, 2.0]),
                              "c.weight": torch.tensor([-1e5, 3.0, 70000.0])})
    mapper = M.Sequential([M.Transpose("a.weight"), M.Cast("b.weight", "fp16", dst="b16.weight")])
    plan = wb.plan(source, mapper, dtype="fp16")
    assert {s.kind for s in plan.steps} >= {"compute", "cast"}
    with pytest.warns(wb.CastOverflowWarning):
        report = wb.convert(source, tmp_path / "out", mapper, dtype="fp16", quiet=True, verify=True)
    assert {n: c for n, (c, _) in report.overflow.items()} == {"a.weight": 1, "b16.weight": 1, "c.weight": 2}
    assert report.verification["overflow"].to_dict() == {"a.weight": 1, "b16.weight": 1, "c.weight": 2}
    fused = M.Sequential([M.Transpose("a.weight"), M.Cast("a.weight", "fp16")])  # an explicit cast inside a computed group
    assert [s.kind for s in wb.plan(source, fused, rest="drop").steps] == ["compute"]
    with pytest.warns(wb.CastOverflowWarning):
        report = wb.convert(source, tmp_path / "fused", fused, rest="drop", quiet=True, verify=True)
    assert {n: c for n, (c, _) in report.overflow.items()} == {"a.weight": 1}
    assert report.verification["overflow"].to_dict() == {"a.weight": 1}


def test_on_overflow_error_fails_before_the_index(tiny_checkpoint, tmp_path: Path) -> None:
    source = _overflow_source(tiny_checkpoint, 70000.0, shards=2)
    dest = tmp_path / "out"
    with pytest.raises(CastOverflowError, match=r"Cannot cast 'hot.weight' to F16: .*overflow.*70000.*--on-overflow") as caught:
        wb.convert(source, dest, dtype="fp16", on_overflow="error", quiet=True)
    assert caught.value.tensor == "hot.weight"
    assert not (dest / INDEX).exists() and not (dest / "model.safetensors").exists()
    assert not [n for n in os.listdir(dest) if n.endswith(".partial")]
    with pytest.raises(PlanError, match="on_overflow"):
        wb.plan(source, dtype="fp16", on_overflow="ignore")
    with pytest.warns(wb.CastOverflowWarning):  # the same run, accepting the overflow, finishes
        wb.convert(source, dest, dtype="fp16", quiet=True)
    assert open_catalog(dest)["hot.weight"].dtype == "F16"


def test_cli_warns_about_overflow_and_fails_in_strict_mode(tiny_checkpoint, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    source = _overflow_source(tiny_checkpoint, 70000.0)
    assert main(["convert", str(source), str(tmp_path / "a"), "--dtype", "fp16", "--verify", "--quiet"]) == 0
    out = capsys.readouterr().out
    warning = [line for line in out.splitlines() if "overflow" in line and "hot.weight" in line]
    assert warning and "largest absolute difference" in out
    assert main(["convert", str(source), str(tmp_path / "b"), "--dtype", "fp16", "--on-overflow", "error", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("workbench convert: Cannot cast 'hot.weight' to F16") and not (tmp_path / "b" / "model.safetensors").exists()


@pytest.mark.distributed
def test_two_local_ranks_report_their_overflow(tiny_checkpoint, tmp_path: Path) -> None:
    source = _overflow_source(tiny_checkpoint, 70000.0, shards=2)
    with pytest.warns(wb.CastOverflowWarning):
        report = wb.convert(source, tmp_path / "out", dtype="fp16", nproc=2, shard_size="8KB", launcher="local", quiet=True)
    assert report.nproc == 2 and {n: c for n, (c, _) in report.overflow.items()} == {"hot.weight": 2, "warm.weight": 1}
    assert sum(bool(r.overflow) for r in report.ranks) == 2  # each rank counted its own tensors
    with pytest.raises(PlanError, match="overflow"):
        wb.convert(source, tmp_path / "strict", dtype="fp16", nproc=2, shard_size="8KB", launcher="local", quiet=True,
                   on_overflow="error")
    assert not (tmp_path / "strict" / INDEX).exists()


def test_float64_and_explicit_integer_casts_count_their_overflow(tiny_checkpoint, tmp_path: Path) -> None:
    source = tiny_checkpoint({"d": torch.tensor([1e300, 1.0, -1e39], dtype=torch.float64),
                              "n": torch.tensor([300, -1, 5], dtype=torch.int16)})
    with pytest.warns(wb.CastOverflowWarning, match="U8"):
        report = wb.convert(source, tmp_path / "out", M.Cast("n", "U8"), dtype="fp32", quiet=True, verify=True)
    assert report.overflow == {"d": (2, 1e300), "n": (2, 300.0)}
    assert report.verification["overflow"].to_dict() == {"d": 2, "n": 2}
    assert load_safetensors_folder(tmp_path / "out")["n"].tolist() == [44, 255, 5]  # what the user asked for: wrapped


def test_save_from_counts_overflow_and_refuses_integer_dtypes(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight[0, 0] = 70000.0
    report = wb.save_from(model, tmp_path / "out", dtype="fp16", quiet=True)
    assert report.overflow == {"weight": (1, 70000.0)} and "warning: overflow" in report.summary()
    with pytest.raises(PlanError, match="Cannot store the weights as int8"):
        wb.save_from(model, tmp_path / "ints", dtype="int8", quiet=True)
    assert not (tmp_path / "ints" / "model.safetensors").exists()
