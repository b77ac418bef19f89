"""Proving checkpoints intact and conversions lossless: checksum sidecars and verify-after-convert."""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import workbench as wb
from tests.conftest import SAMPLES
from workbench import mapper as M
from workbench.cli import main as cli_main
from workbench.conversion import execute
from workbench.engine.output_check import check_outputs
from workbench.explore.checksums import SIDECAR_NAME, default_sidecar, tensor_sha256
from workbench.explore.verify import verify
from workbench.formats import open_catalog
from workbench.iostats import IO
from workbench.output.safetensors import SafetensorsWriter

TRAINING = SAMPLES / "training"


def flip_byte_of(path: Path, tensor: str) -> None:
    """Flip one bit inside `tensor`'s data in a safetensors file (silent corruption: headers stay valid)."""
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    entry = json.loads(raw[8 : 8 + n])[tensor]
    raw[8 + n + entry["data_offsets"][0]] ^= 0x01
    path.write_bytes(bytes(raw))


def test_first_run_records_later_runs_check_and_name_each_changed_tensor(llama_sample: Path, tmp_path: Path) -> None:
    folder = tmp_path / "ck"
    shutil.copytree(llama_sample, folder)
    first = verify(folder, checksums=True)
    assert first.ok and first.checksums.action == "recorded" and first.checksums.sidecar == folder / SIDECAR_NAME
    recorded = json.loads((folder / SIDECAR_NAME).read_text())["tensors"]
    assert len(recorded) == 39 and all(len(v["sha256"]) == 64 for v in recorded.values())
    assert verify(folder, checksums=True).checksums.action == "checked" and verify(folder, checksums=True).ok

    flip_byte_of(folder / "model-00002-of-00003.safetensors", "model.layers.1.mlp.up_proj.weight")
    report = verify(folder, checksums=True)
    assert not report.ok and report.checksums.names("mismatch") == ["model.layers.1.mlp.up_proj.weight"]
    assert [f.tensor for f in report.errors] == ["model.layers.1.mlp.up_proj.weight"]
    assert "MISMATCH" in report.summary() and "38 ok, 1 mismatch" in report.summary()

    sums = json.loads((folder / SIDECAR_NAME).read_text())
    sums["tensors"]["gone.weight"] = dict(sums["tensors"]["lm_head.weight"])
    del sums["tensors"]["model.norm.weight"]
    (folder / SIDECAR_NAME).write_text(json.dumps(sums))
    report = verify(folder, checksums=True)
    assert report.checksums.names("missing") == ["gone.weight"] and report.checksums.names("unrecorded") == ["model.norm.weight"]
    assert any(w.tensor == "model.norm.weight" for w in report.warnings)

    assert verify(folder, record=True).checksums.action == "recorded"  # --record: accept the current bytes
    assert verify(folder, checksums=True).ok


def test_cli_records_checks_and_exits_non_zero_on_mismatch(llama_sample: Path, tmp_path: Path, capsys) -> None:
    folder = tmp_path / "ck"
    shutil.copytree(llama_sample, folder)
    sidecar = tmp_path / "elsewhere.json"
    assert cli_main(["verify", str(folder), "--sidecar", str(sidecar)]) == 0
    assert "recorded 39 tensors" in capsys.readouterr().out and sidecar.exists() and not (folder / SIDECAR_NAME).exists()
    assert cli_main(["verify", str(folder), "--sidecar", str(sidecar)]) == 0
    assert "all match" in capsys.readouterr().out
    flip_byte_of(folder / "model-00001-of-00003.safetensors", "model.embed_tokens.weight")
    assert cli_main(["verify", str(folder), "--checksums", "--sidecar", str(sidecar)]) == 2
    captured = capsys.readouterr()
    assert "'model.embed_tokens.weight' does not match its recorded checksum" in captured.err
    sidecar.write_text("{not json")
    assert cli_main(["verify", str(folder), "--sidecar", str(sidecar)]) == 2
    assert "Cannot read checksum sidecar" in capsys.readouterr().err


def test_single_file_sidecar_sits_beside_it_and_is_not_copied_by_conversions(bert_sample: Path, tmp_path: Path) -> None:
    folder = tmp_path / "bert"
    shutil.copytree(bert_sample, folder)
    assert default_sidecar(folder / "model.safetensors") == folder / f"model.safetensors.{SIDECAR_NAME}"
    assert verify(folder / "model.safetensors", checksums=True).checksums.action == "recorded"
    assert verify(folder, checksums=True).checksums.sidecar == folder / SIDECAR_NAME
    report = wb.convert(folder, tmp_path / "out", quiet=True)
    assert report.extras == ["config.json"]
    assert sorted(os.listdir(tmp_path / "out")) == [".workbench-complete.json", "config.json", "model.safetensors"]


def test_hashing_reads_in_bounded_chunks(llama_sample: Path) -> None:
    catalog = open_catalog(llama_sample)
    name = "model.embed_tokens.weight"
    IO.reset()
    digest = tensor_sha256(catalog, name, chunk_bytes=1000)
    io = IO.snapshot()
    assert io["bytes_read"] == catalog[name].nbytes and io["read_calls"] == math.ceil(catalog[name].nbytes / 1000)
    assert digest == tensor_sha256(catalog, name)


@pytest.mark.parametrize("source", [TRAINING / "torch" / "pytorch_model.bin", TRAINING / "dcp_2ranks", TRAINING / "atorch_flat"])
def test_a_source_sidecar_proves_its_safetensors_conversion_lossless(source: Path, tmp_path: Path) -> None:
    """Digests cover row-major bytes, not files: a torch, DCP or atorch sidecar checks the converted output."""
    sidecar = tmp_path / "source.sha256.json"
    assert verify(source, sidecar=sidecar).checksums.action == "recorded"
    wb.convert(source, tmp_path / "out", quiet=True, extras=False)
    report = verify(tmp_path / "out", sidecar=sidecar)
    assert report.ok and report.checksums.action == "checked"
    assert set(report.checksums.names("ok")) == set(open_catalog(source).tensors)


# ------------------------------------------------------------------------------------- verify after convert


def test_verified_reshard_compares_every_byte(llama_sample: Path, tmp_path: Path) -> None:
    report = wb.convert(llama_sample, tmp_path / "out", shard_size="300KB", quiet=True, verify=True)
    frame = report.verification
    assert report.verified is True and len(frame) == 39 and set(frame.check) == {"bytes"} and set(frame.status) == {"ok"}
    assert (frame.max_abs_diff == 0).all()
    assert "39 output tensors re-read" in report.summary() and "all match" in report.summary()


def test_verified_cast_is_within_bf16_rounding(llama_sample: Path, tmp_path: Path) -> None:
    report = wb.convert(llama_sample, tmp_path / "out", dtype="bf16", quiet=True, verify=True, chunk_size="4KiB")
    frame = report.verification
    assert report.verified and set(frame.check) == {"cast"}
    source = open_catalog(llama_sample)
    for name, row in frame.iterrows():
        values = torch.frombuffer(bytearray(source.read_bytes(name)), dtype=torch.float32)
        bound = float(values.abs().max()) * 2.0**-8  # half an ulp of bf16's 8-bit significand, at the largest value
        assert 0 <= row.max_abs_diff <= bound, name
    assert (frame.max_abs_diff > 0).sum() > 20  # real rounding happened (norm weights of ones are exact)


def test_verified_compute_group_and_detection_of_corrupt_output(llama_sample: Path, tmp_path: Path) -> None:
    mapper = M.Transpose("lm_head.weight")
    plan = wb.plan(llama_sample, mapper, shard_size="300KB", dest=tmp_path / "out")
    report = execute(plan, quiet=True, verify=True)
    frame = report.verification
    assert report.verified and frame.loc["lm_head.weight", "check"] == "compute"
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"]
    flip_byte_of(tmp_path / "out" / index["model.layers.0.self_attn.q_proj.weight"], "model.layers.0.self_attn.q_proj.weight")
    flip_byte_of(tmp_path / "out" / index["lm_head.weight"], "lm_head.weight")
    checked = check_outputs(plan)
    assert not checked.ok and sorted(checked.mismatches) == ["lm_head.weight", "model.layers.0.self_attn.q_proj.weight"]
    assert "do NOT match" in checked.summary()


def test_cli_convert_verify_exits_non_zero_when_the_disk_corrupts_a_shard(llama_sample: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    assert cli_main(["convert", str(llama_sample), str(tmp_path / "good"), "--verify", "--quiet"]) == 0
    assert "all match" in capsys.readouterr().out
    real_commit = SafetensorsWriter.commit

    def corrupting_commit(self, *args, **kwargs):  # a bit flips between the write and the disk
        last = self.partial_path.read_bytes()[-1]
        os.pwrite(self._fd, bytes([last ^ 0x40]), self.layout.size - 1)
        return real_commit(self, *args, **kwargs)

    monkeypatch.setattr(SafetensorsWriter, "commit", corrupting_commit)
    assert cli_main(["convert", str(llama_sample), str(tmp_path / "bad"), "--verify", "--quiet"]) == 1
    captured = capsys.readouterr()
    assert "mismatch:" in captured.out and "do not match the source" in captured.err
    assert load_file(str(tmp_path / "bad" / "model.safetensors"))  # the file itself is well-formed: only values differ
