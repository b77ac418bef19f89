"""Issue 29, the command line's edges: names from a file never reach the terminal raw (C3), what the
command line cannot mean is refused with a clear message (D8, D9, D10, D17, D18) and `inspect` opens
DeepSpeed runs as `convert` does (D5)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from workbench.cli import commands as cli
from workbench.cli.terminal import escape
from workbench.files import temp_name

REPO = Path(__file__).resolve().parents[2]
LLAMA = REPO / "sample_checkpoints" / "tiny-llama"
HOSTILE_NAMES = ["\x1b[2J\x1b[31mred", "bell\x07", "back\rwards", "right\u202eto-left", "new\nline", "csi\x9b31m"]


def run(*args: str | Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Run the CLI in-process; returns (exit status, stdout, stderr)."""
    status = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return status, out, err


def raw_safetensors(path: Path, names: list[str]) -> Path:
    """A safetensors file whose tensor names are `names` (one F32 each), header written by hand."""
    header = {name: {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i, name in enumerate(names)}
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + b"\0" * (4 * len(names)))
    return path


def no_control_characters(text: str, allowed: str = "\n") -> bool:
    return all(c.isprintable() or c in allowed for c in text)


# ------------------------------------------------------------------------------------ C3 escapes


def test_escape_writes_what_repr_writes() -> None:
    for name in HOSTILE_NAMES:
        assert escape(name) == repr(name)[1:-1].replace("\\\\", "\\").replace("\\'", "'")
    assert escape("model.layers.0.q_proj.weight") == "model.layers.0.q_proj.weight"
    assert escape("plain\nlines", keep="\n") == "plain\nlines"
    assert escape("caf\u00e9 \u4e2d\u6587") == "caf\u00e9 \u4e2d\u6587"  # printable non-ASCII stays readable


@pytest.mark.parametrize("fmt", ["table", "csv"])
def test_inspect_escapes_names_from_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str], fmt: str) -> None:
    path = raw_safetensors(tmp_path / "evil.safetensors", HOSTILE_NAMES)
    status, out, err = run("inspect", path, "--format", fmt, capsys=capsys)
    assert status == 0, err
    assert no_control_characters(out) and no_control_characters(err)
    assert "\\x1b[2J\\x1b[31mred" in out and "\\u202e" in out and "\\x9b31m" in out
    if fmt == "table":  # inside the table a newline or carriage return in a name is escaped too
        assert "new\\nline" in out and "back\\rwards" in out


def test_inspect_json_stays_exact(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = raw_safetensors(tmp_path / "evil.safetensors", HOSTILE_NAMES)
    status, out, _ = run("inspect", path, "--format", "json", capsys=capsys)
    assert status == 0
    assert sorted(t["name"] for t in json.loads(out)["tensors"]) == sorted(HOSTILE_NAMES)


def test_plan_diff_and_errors_escape_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    evil = raw_safetensors(tmp_path / "evil.safetensors", HOSTILE_NAMES)
    other = tmp_path / "other.safetensors"
    save_file({"x": np.zeros(1, np.float32)}, str(other))
    cases = [(["plan", evil], False), (["diff", evil, other], True), (["convert", evil, tmp_path / "out", "--quiet"], False),
             (["convert", evil, tmp_path / "out2", "--rest", "error", "--mapper", mapper_dropping(tmp_path)], True)]
    for args, names_shown in cases:
        status, out, err = run(*args, capsys=capsys)
        assert no_control_characters(out) and no_control_characters(err), (args, out, err)
        assert status in (0, 1, 2)
        assert not names_shown or "\\x1b[2J" in out + err, (args, out, err)


def test_text_the_plan_renders_raw_is_escaped_on_the_way_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The plan lists extra files by their names as found: the output guard escapes them, not each renderer."""
    folder = tmp_path / "model"
    folder.mkdir()
    save_file({"a": np.zeros(2, np.float32)}, str(folder / "model.safetensors"))
    (folder / "\x1b[2Jtokenizer\x07.json").write_text("{}")
    status, out, err = run("plan", folder, "--dest", tmp_path / "out", capsys=capsys)
    assert status == 0, err
    assert no_control_characters(out) and "\\x1b[2Jtokenizer\\x07.json" in out


def mapper_dropping(folder: Path) -> Path:
    path = folder / "drop.py"
    path.write_text("from workbench import mapper as M\nmapper = M.Drop('nothing.here')\n")
    return path


# ------------------------------------------------------------------------ C4 long temporary names


LONG_EXTRA = "x" * 245 + ".json"  # 250 bytes: the file system takes it, `<name>.partial` (258) it does not


def test_an_extra_with_a_name_at_the_limit_is_copied(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    save_file({"a": np.arange(4, dtype=np.float32)}, str(folder / "model.safetensors"))
    (folder / LONG_EXTRA).write_text('{"long": true}')
    status, _, err = run("convert", folder, tmp_path / "out", "--quiet", capsys=capsys)
    assert status == 0, err
    assert (tmp_path / "out" / LONG_EXTRA).read_text() == '{"long": true}'
    assert not [n for n in os.listdir(tmp_path / "out") if n.endswith(".partial")]


def test_a_crashed_runs_hashed_temporary_is_the_workbenchs_own(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Resume: the hashed temporary a run killed while copying the long extra leaves behind does not make the
    folder foreign, and the resumed run removes it."""
    from workbench.engine import finalize

    folder = tmp_path / "model"
    folder.mkdir()
    save_file({"a": np.arange(4, dtype=np.float32)}, str(folder / "model.safetensors"))
    (folder / LONG_EXTRA).write_text("{}")
    dest = tmp_path / "out"
    leftover = temp_name(LONG_EXTRA, tmp_path)
    assert leftover.endswith(".partial") and len(leftover.encode()) <= 255 and leftover.startswith("xxxx")
    assert temp_name(LONG_EXTRA, tmp_path) == leftover != temp_name("y" + LONG_EXTRA[1:], tmp_path)  # stable, per name
    assert temp_name("config.json", tmp_path) == "config.json.partial"

    def crash(*args, **kwargs):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(finalize, "copy_atomic", crash)
    status, _, err = run("convert", folder, dest, "--quiet", capsys=capsys)
    assert status == 2 and "Input/output error" in err
    monkeypatch.undo()
    (dest / leftover).write_text("half")  # what kill -9 during the copy leaves
    status, _, err = run("convert", folder, dest, "--quiet", capsys=capsys)
    assert status == 0, err
    assert (dest / LONG_EXTRA).read_text() == "{}" and not (dest / leftover).exists()


def test_temporary_names_follow_the_file_systems_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from workbench import files

    monkeypatch.setattr(files.os, "pathconf", lambda path, what: 143)  # eCryptfs-like
    name = "n" * 140
    temp = files.temp_path(tmp_path / name)
    assert len(temp.name.encode()) <= 143 and temp.name.endswith(".partial") and temp.parent == tmp_path
    with files.AtomicWriter(tmp_path / name) as writer:
        assert writer.temp == temp
        writer.write(b"ok")
    assert (tmp_path / name).read_bytes() == b"ok"


# --------------------------------------------------------------------------- D18 usage and help


@pytest.mark.parametrize(("args", "typo", "meant"), [(["inspect", str(LLAMA), "--fromat", "json"], "--fromat", "--format"),
                                                     (["convert", "a", "b", "--shard-szie", "5GB"], "--shard-szie", "--shard-size"),
                                                     (["plan", "a", "--mappr=m.py"], "--mappr", "--mapper")])
def test_a_mistyped_flag_gets_the_commands_usage_and_a_suggestion(args: list[str], typo: str, meant: str,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        cli.main(args)
    err = capsys.readouterr().err
    assert stop.value.code == 2
    assert err.startswith(f"usage: workbench {args[0]} ")  # the subcommand's usage, not the top level's
    assert f"Did you mean {meant} (for {typo})?" in err


def test_help_names_urls_and_every_output_format(capsys: pytest.CaptureFixture[str]) -> None:
    texts = {}
    for command in ([], ["inspect"], ["convert"], ["plan"], ["verify"]):
        with pytest.raises(SystemExit):
            cli.main([*command, "--help"])
        texts[" ".join(command)] = " ".join(capsys.readouterr().out.split())
    assert all("hf://org/repo" in text and "s3://bucket/prefix/" in text and "https://" in text for text in texts.values())
    assert "to HF safetensors shards" not in texts[""]
    assert "safetensors shards, DCP, GGUF or Meta .pth" in texts[""]


# ------------------------------------------------------------------ D5 inspect opens as convert does


def deepspeed_run(name: str) -> Path:
    """A DeepSpeed run built by scripts/make_deepspeed_fixtures.py; skips when the fixtures are not built."""
    import subprocess
    import sys

    script = REPO / "scripts" / "make_deepspeed_fixtures.py"
    root = Path(subprocess.run([sys.executable, str(script), "--print-root"], capture_output=True, text=True, check=True).stdout.strip())
    if not (root / "done").exists() or (root / name / "failed").exists():
        pytest.skip("DeepSpeed fixtures not built; run `python scripts/make_deepspeed_fixtures.py`")
    return root / name


def test_inspect_takes_the_deepspeed_selection_flags(capsys: pytest.CaptureFixture[str]) -> None:
    import workbench as wb

    run_path = deepspeed_run("stage2")
    status, out, err = run("inspect", run_path, "--zero-weights", "module", "--format", "json", capsys=capsys)
    assert status == 0, err
    tensors = {t["name"]: t["dtype"] for t in json.loads(out)["tensors"]}
    module = wb.open_checkpoint(run_path, weights="module")
    assert set(tensors) == set(module.tensors.index) and set(tensors.values()) == {"BF16"}
    status, out, err = run("inspect", run_path, "--zero-moments", "--format", "json", capsys=capsys)
    assert status == 0, err
    names = [t["name"] for t in json.loads(out)["tensors"]]
    assert any(n.endswith(".exp_avg_sq") for n in names) and len(names) == len(wb.open_checkpoint(run_path, moments=True).tensors)


@pytest.mark.parametrize(("args", "meant"), [(["inpsect", "x"], "inspect"), (["convert", "a", "b", "--rest", "kep"], "keep")])
def test_a_mistyped_choice_names_the_closest_one(args: list[str], meant: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        cli.main(args)
    assert stop.value.code == 2 and capsys.readouterr().err.rstrip().endswith(f"Did you mean {meant}?")
