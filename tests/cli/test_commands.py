"""The `workbench` command: output formats, exit codes, clear errors, and header-only speed."""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from workbench.cli import commands as cli
from workbench.formats import open_catalog

REPO = Path(__file__).resolve().parents[2]
LLAMA = REPO / "sample_checkpoints" / "tiny-llama"
BERT = REPO / "sample_checkpoints" / "tiny-bert"


def run(*args: str | Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Run the CLI in-process; returns (exit status, stdout, stderr)."""
    status = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return status, out, err


def run_process(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """Run `python -m workbench` in a fresh interpreter, as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "workbench", *map(str, args)], capture_output=True, text=True, cwd=REPO, timeout=120
    )


def column_starts(header: str) -> list[int]:
    starts, previous = [], " "
    for i, ch in enumerate(header):
        if ch != " " and previous == " ":
            starts.append(i)
        previous = ch
    return starts


# ---------------------------------------------------------------------------------------- inspect


def test_inspect_table_has_a_summary_and_aligned_columns(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run("inspect", LLAMA, capsys=capsys)
    assert status == 0 and err == ""
    lines = out.splitlines()
    catalog = open_catalog(LLAMA)
    assert lines[0].startswith(f"{LLAMA}: hf-sharded, 3 files, {len(catalog)} tensors")
    assert "706.2 KiB" in lines[0]  # 723200 bytes
    assert lines[1] == "dtypes: F32 x39 (706.2 KiB)"
    header = lines[3]
    assert header.split() == ["name", "dtype", "shape", "numel", "size", "file"]
    rows = [line for line in lines[5:] if line and not line.startswith("suggested preset: ")]
    assert len(rows) == len(catalog)
    assert lines[-2:] == [  # the presets that apply, after the table (config.json says llama)
        "suggested preset: hf_to_fused (separate q/k/v and gate/up projections: fuse them into qkv_proj and gate_up_proj)",
        "suggested preset: hf_to_meta (llama in HF layout: Meta's original names with the rotary permutation undone)",
    ]
    dtype_col = header.index("dtype")
    file_col = header.index("file")
    for row in rows:
        assert row[dtype_col : dtype_col + 3] == "F32"
        assert row[file_col:].startswith("model-0000")
    # natural order: layer 10 would come after layer 9; here layers 0..3 appear in order
    names = [r.split()[0] for r in rows]
    layer_numbers = [int(n.split(".")[2]) for n in names if n.startswith("model.layers.")]
    assert layer_numbers == sorted(layer_numbers)
    embed = next(r for r in rows if r.startswith("model.embed_tokens.weight"))
    assert "[256, 64]" in embed and "16,384" in embed and "64.0 KiB" in embed


def test_inspect_json_is_machine_readable_and_matches_the_catalog(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run("inspect", LLAMA, "--format", "json", capsys=capsys)
    assert status == 0
    doc = json.loads(out)
    catalog = open_catalog(LLAMA)
    summary = doc["summary"]
    assert summary["format"] == "hf-sharded" and summary["tensors"] == len(catalog) == len(doc["tensors"])
    assert summary["total_bytes"] == catalog.total_bytes == sum(t["nbytes"] for t in doc["tensors"])
    assert summary["dtypes"] == {"F32": {"tensors": len(catalog), "bytes": catalog.total_bytes}}
    for record in doc["tensors"]:
        info = catalog[record["name"]]
        assert (record["dtype"], tuple(record["shape"]), record["file"], record["begin"], record["end"]) == (
            info.dtype, info.shape, info.file, info.begin, info.end,
        )


def test_inspect_csv(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run("inspect", BERT, "--format", "csv", capsys=capsys)
    assert status == 0
    rows = list(csv.DictReader(io.StringIO(out)))
    catalog = open_catalog(BERT)
    assert len(rows) == len(catalog)
    assert list(rows[0]) == ["name", "dtype", "shape", "numel", "nbytes", "file", "begin", "end"]
    for row in rows:
        info = catalog[row["name"]]
        assert json.loads(row["shape"]) == list(info.shape) and int(row["nbytes"]) == info.nbytes


def test_inspect_layers_folds_repeated_tensors(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run("inspect", LLAMA, "--layers", capsys=capsys)
    assert status == 0
    row = next(line for line in out.splitlines() if line.startswith("model.layers.{i}.mlp.up_proj.weight"))
    assert row.split()[1:3] == ["4", "0-3"] and "[128, 64]" in row and "128.0 KiB" in row
    status, out, _ = run("inspect", LLAMA, "--layers", "--format", "json", capsys=capsys)
    layers = {r["pattern"]: r for r in json.loads(out)["layers"]}
    assert layers["model.layers.{i}.self_attn.k_proj.weight"]["count"] == 4
    assert layers["model.layers.{i}.self_attn.k_proj.weight"]["shape"] == [32, 64]
    assert len(layers) == 12


def test_inspect_filter_by_glob_and_template(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run("inspect", LLAMA, "--format", "json", "--filter", "*.self_attn.q_proj.*", capsys=capsys)
    names = [t["name"] for t in json.loads(out)["tensors"]]
    assert names == [f"model.layers.{i}.self_attn.q_proj.weight" for i in range(4)]
    _, out, _ = run(
        "inspect", LLAMA, "--format", "json", "--filter", "model.layers.{i}.mlp.up_proj.weight", "--filter", "lm_head.weight",
        capsys=capsys,
    )
    doc = json.loads(out)
    assert doc["summary"]["shown"] == 5 and doc["summary"]["tensors"] == 39
    status, out, err = run("inspect", LLAMA, "--filter", "nothing.*", capsys=capsys)
    assert status == 0 and "no tensor" in err and "showing 0 of 39" in out


def test_inspect_filter_uses_the_one_filter_rule(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run("inspect", LLAMA, "--format", "json", "--filter", "layers.{i}.self_attn.q_proj.*", capsys=capsys)
    assert [t["name"] for t in json.loads(out)["tensors"]] == [f"model.layers.{i}.self_attn.q_proj.weight" for i in range(4)]
    _, out, _ = run("inspect", LLAMA, "--format", "json", "--filter", "norm.weight", capsys=capsys)
    assert [t["name"] for t in json.loads(out)["tensors"]] == ["model.norm.weight"]
    status, _, err = run("inspect", LLAMA, "--filter", "attn", capsys=capsys)
    assert status == 0 and "write '*attn*'" in err
    status, _, err = run("inspect", LLAMA, "--filter", "layers.{i", capsys=capsys)
    assert status == 2 and "malformed placeholder" in err


def test_inspect_does_not_import_torch_or_pandas() -> None:
    code = (
        "import sys, io, contextlib\n"
        "from workbench.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    status = main(['inspect', {str(LLAMA)!r}])\n"
        "heavy = sorted(m for m in ('torch', 'pandas') if m in sys.modules)\n"
        "print(status, heavy)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.stdout.strip() == "0 []", done.stderr
    # How fast it is, is measured by benchmarks/bench_open.py (`workbench inspect` row), not here.


def test_header_only_subcommands_do_not_import_torch() -> None:
    commands = [["inspect", str(LLAMA), "--layers"], ["verify", str(LLAMA)], ["diff", str(LLAMA), str(BERT)]]
    code = (
        "import sys, io, contextlib\n"
        "from workbench.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    statuses = [main(args) for args in {commands!r}]\n"
        "print(statuses, 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.stdout.strip() == "[0, 0, 1] False", done.stderr


def test_console_entry_point_and_module_run_the_same_main() -> None:
    done = run_process("inspect", BERT, "--format", "json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["summary"]["tensors"] == 39
    script = Path(sys.executable).parent / "workbench"
    if script.exists():
        via_script = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60)
        assert via_script.returncode == 0 and via_script.stdout.startswith("workbench ")


# ------------------------------------------------------------------------------------ bad input


def test_missing_path_is_exit_2_with_a_clear_message(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    status, out, err = run("inspect", missing, capsys=capsys)
    assert status == 2 and out == ""
    assert err.startswith("workbench inspect: Cannot open checkpoint") and str(missing) in err and "Traceback" not in err


def test_corrupt_file_message_names_file_and_tensor_without_traceback(tmp_path: Path) -> None:
    path = tmp_path / "broken.safetensors"
    save_file({"encoder.weight": np.ones((4, 4), np.float32)}, str(path))
    path.write_bytes(path.read_bytes()[:-10])
    done = run_process("inspect", path)
    assert done.returncode == 2 and done.stdout == ""
    assert "Traceback" not in done.stderr
    assert str(path) in done.stderr and "'encoder.weight'" in done.stderr and "truncated" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def _huge_integer_inputs(tmp_path: Path) -> dict[str, Path]:
    """Checkpoints holding integers of thousands of digits where a size, an offset or a version belongs."""
    import pickle
    import zipfile

    out = {}
    body = b'{"w": {"dtype": "U8", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 0]}}'
    out["safetensors dimension"] = tmp_path / "dim.safetensors"
    out["safetensors dimension"].write_bytes(len(body).to_bytes(8, "little") + body)
    body = b'{"w": {"dtype": "U8", "shape": [0], "data_offsets": [' + b"9" * 4000 + b", " + b"9" * 4000 + b"]}}"
    out["safetensors offsets"] = tmp_path / "offsets.safetensors"
    out["safetensors offsets"].write_bytes(len(body).to_bytes(8, "little") + body)
    out["HF index"] = tmp_path / "hf"
    out["HF index"].mkdir()
    save_file({"w": np.ones(2, np.float32)}, str(out["HF index"] / "model.safetensors"))
    (out["HF index"] / "model.safetensors.index.json").write_text(
        '{"metadata": {"total_size": ' + "9" * 5000 + '}, "weight_map": {"w": "model.safetensors"}}'
    )
    out["Lightning version"] = tmp_path / "epoch=1.ckpt"
    with zipfile.ZipFile(out["Lightning version"], "w") as archive:
        archive.writestr("archive/data.pkl", pickle.dumps({"pytorch-lightning_version": 1 << 24_000, "state_dict": {}}, protocol=2))
    return out


def test_integers_of_thousands_of_digits_are_clear_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    inputs = _huge_integer_inputs(tmp_path)
    for what, path in inputs.items():
        for command in ("inspect", "verify"):
            status, _, err = run(command, path, capsys=capsys)
            assert status != 0, (what, command)
            assert "Cannot" in err and "internal error" not in err and "set_int_max_str_digits" not in err, (what, command, err)
    done = run_process("inspect", inputs["Lightning version"])  # as a user runs it: no traceback
    assert done.returncode == 2 and "Traceback" not in done.stderr and "an integer of 3001 bytes" in done.stderr


def test_unknown_format_and_empty_folder_are_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    status, _, err = run("inspect", LLAMA / "config.json", capsys=capsys)
    assert status == 2 and "not in a format the workbench knows" in err
    (tmp_path / "empty").mkdir()
    status, _, err = run("inspect", tmp_path / "empty", capsys=capsys)
    assert status == 2 and str(tmp_path / "empty") in err


def test_os_errors_become_messages(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    def denied(path: object) -> None:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr("workbench.formats.open_catalog", denied)
    status, _, err = run("inspect", LLAMA, capsys=capsys)
    assert status == 2 and err == f"workbench inspect: Cannot inspect {LLAMA}: Permission denied. Check the path and its permissions.\n"


def test_unexpected_errors_are_reported_as_bugs(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(path: object) -> None:
        raise ValueError("boom")

    monkeypatch.setattr("workbench.formats.open_catalog", broken)
    status, _, err = run("inspect", LLAMA, capsys=capsys)
    assert status == 3 and "internal error: ValueError: boom" in err and "--debug" in err and "Traceback" not in err
    status, _, err = run("--debug", "inspect", LLAMA, capsys=capsys)
    assert status == 3 and "Traceback" in err


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        cli.main(["inspect", str(LLAMA), "--format", "xml"])
    assert caught.value.code == 2
    with pytest.raises(SystemExit) as caught:
        cli.main([])
    assert caught.value.code == 2


def test_every_subcommand_is_registered_with_help() -> None:
    parser = cli.build_parser()
    help_text = parser.format_help()
    for sub in cli.SUBCOMMANDS:
        assert sub.name in help_text
    assert {"inspect", "diff", "verify"} <= {s.name for s in cli.SUBCOMMANDS}


# ------------------------------------------------------------------------------------------- diff


def _single(path: Path, tensors: dict[str, np.ndarray]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def test_diff_identical_is_exit_0(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(LLAMA, copy)
    status, out, _ = run("diff", LLAMA, copy, capsys=capsys)
    assert status == 0 and "hold the same 39 tensors" in out


def test_diff_lists_added_removed_and_changed(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    a = _single(tmp_path / "a.safetensors", {"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32), "gone": np.zeros(1, np.int8)})
    b = _single(tmp_path / "b.safetensors", {"w": np.zeros((3, 2), np.float32), "b": np.zeros(3, np.float16), "new": np.zeros(1, np.int8)})
    status, out, _ = run("diff", a, b, capsys=capsys)
    assert status == 1
    rows = {line.split()[0]: line for line in out.splitlines()[3:]}
    assert "removed" in rows["gone"] and "added" in rows["new"]
    assert "shape changed" in rows["w"] and "[2, 3]" in rows["w"] and "[3, 2]" in rows["w"]
    assert "dtype changed" in rows["b"] and "F16" in rows["b"]
    status, out, _ = run("diff", a, b, "--format", "json", capsys=capsys)
    by_name = {r["name"]: r for r in json.loads(out)["differences"]}
    assert by_name["w"]["status"] == "shape changed" and by_name["w"]["other_shape"] == [3, 2]
    assert by_name["gone"]["other_dtype"] is None


def test_diff_values(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    a = _single(tmp_path / "a.safetensors", {"w": np.zeros(4, np.float32), "same": np.ones(2, np.float32)})
    b = _single(tmp_path / "b.safetensors", {"w": np.array([0, 0, 0.5, 0], np.float32), "same": np.ones(2, np.float32)})
    status, _, _ = run("diff", a, b, capsys=capsys)
    assert status == 0  # metadata alone cannot see it
    status, out, _ = run("diff", a, b, "--values", "--format", "json", capsys=capsys)
    assert status == 1
    (row,) = json.loads(out)["differences"]
    assert row["name"] == "w" and row["status"] == "values changed" and row["max_abs_diff"] == 0.5


def test_diff_bad_input_is_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    status, _, err = run("diff", LLAMA, tmp_path / "missing", capsys=capsys)
    assert status == 2 and "workbench diff: Cannot open checkpoint" in err


# ----------------------------------------------------------------------------------------- verify


def test_verify_sound_checkpoints(capsys: pytest.CaptureFixture[str]) -> None:
    for sample in (LLAMA, BERT):
        status, out, err = run("verify", sample, capsys=capsys)
        assert status == 0 and err == ""
        assert out.startswith(f"{sample}: OK")


def test_verify_reports_every_broken_shard(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(LLAMA, broken)
    (broken / "model-00001-of-00003.safetensors").unlink()
    shard = broken / "model-00003-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    status, out, err = run("verify", broken, capsys=capsys)
    assert status == 2
    assert "FAILED (2 problems)" in out.splitlines()[0]
    assert "model-00001-of-00003.safetensors" in out and "missing" in out
    assert "model-00003-of-00003.safetensors" in out and "truncated" in out
    assert err.startswith("workbench verify: ") and "model-00001-of-00003.safetensors" in err and "1 more listed above" in err


def test_verify_single_file_with_trailing_bytes(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = _single(tmp_path / "m.safetensors", {"w": np.zeros(4, np.float32)})
    with open(path, "ab") as fh:
        fh.write(b"junk")
    status, out, err = run("verify", path, capsys=capsys)
    assert status == 2 and "trailing" in out and str(path) in err


def test_verify_warnings_keep_exit_0(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(LLAMA, copy)
    (copy / "model-00002-of-00003.safetensors.partial").write_bytes(b"\0" * 16)
    status, out, _ = run("verify", copy, capsys=capsys)
    assert status == 0 and "OK, 1 warning -" in out and "unfinished write" in out


def test_unreadable_shard(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(LLAMA, copy)
    (copy / "model-00002-of-00003.safetensors").chmod(0)
    if os.geteuid() != 0:
        status, _, err = run("inspect", copy, capsys=capsys)
    else:  # root reads any file through CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH: run the command without them
        done = subprocess.run(["setpriv", "--bounding-set", "-dac_override,-dac_read_search", sys.executable, "-m", "workbench",
                               "inspect", str(copy)], capture_output=True, text=True, cwd=REPO, timeout=120)
        status, err = done.returncode, done.stderr
    assert status == 2 and "model-00002-of-00003.safetensors" in err and "Permission denied" in err
