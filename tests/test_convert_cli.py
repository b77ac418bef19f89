"""`workbench plan` and `workbench convert` from the shell: output, exit codes, no torch for byte copies."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from workbench.cli import main
from workbench.formats import open_catalog

FUSE_GATE_UP = """from workbench import mapper as M

mapper = M.Concat(['model.layers.{i}.mlp.gate_proj.weight', 'model.layers.{i}.mlp.up_proj.weight'],
                  'model.layers.{i}.mlp.gate_up_proj.weight')
"""


@pytest.fixture
def mapper_file(tmp_path: Path) -> Path:
    path = tmp_path / "mapper.py"
    path.write_text(FUSE_GATE_UP)
    return path


def test_convert_from_the_shell_without_torch(llama_sample: Path, tmp_path: Path, mapper_file: Path) -> None:
    dest = tmp_path / "out"
    code = (
        "import sys\nfrom workbench.cli import main\n"
        f"rc = main(['convert', {str(llama_sample)!r}, {str(dest)!r}, '--mapper', {str(mapper_file)!r}, "
        "'--shard-size', '300KB', '--quiet'])\n"
        "print('EXIT', rc, 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "EXIT 0 False" in done.stdout
    plan_at, report_at = done.stdout.index("Plan: "), done.stdout.index("Converted into")
    assert plan_at < report_at and "files opened match the plan: yes" in done.stdout
    catalog = open_catalog(dest)
    assert "model.layers.3.mlp.gate_up_proj.weight" in catalog and "model.layers.3.mlp.up_proj.weight" not in catalog
    assert catalog["model.layers.3.mlp.gate_up_proj.weight"].shape == (256, 64)
    assert (dest / "config.json").exists() and "Traceback" not in done.stderr


def test_plan_command_prints_the_dry_run(llama_sample: Path, mapper_file: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", str(llama_sample), "--mapper", str(mapper_file), "--shard-size", "300KB", "--nproc", "2"]) == 0
    out = capsys.readouterr().out
    assert "status: OK" in out and "ranks: 2" in out and "model-00003-of-00003.safetensors" in out


def test_dry_run_cast_and_no_extras(llama_sample: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    dest = tmp_path / "out"
    assert main(["convert", str(llama_sample), str(dest), "--dtype", "bf16", "--dry-run"]) == 0
    assert "casts by numpy" in capsys.readouterr().out and not dest.exists()
    assert main(["convert", str(llama_sample), str(dest), "--dtype", "bf16", "--no-extras", "--quiet"]) == 0
    assert sorted(os.listdir(dest)) == ["model.safetensors"]
    assert {t.dtype for t in open_catalog(dest).values()} == {"BF16"}


@pytest.mark.parametrize(
    ("mapper_text", "args", "expected"),
    [
        (None, ["--mapper", "missing.py"], "no such file"),
        ("mapper = (", [], "syntax error at line 1"),
        ("x = 1\n", [], "defines no name `mapper`"),
        ("raise ValueError('nope')\n", [], "raised ValueError: nope"),
        (None, ["--shard-size", "5 parsecs"], "Cannot use shard size"),
        (None, ["--dtype", "int3"], "Cannot use dtype"),
        ("from workbench import mapper as M\nmapper = M.Rename('nope', 'x')\n", [], "nope"),
    ],
)
def test_bad_input_exits_2_with_one_message(llama_sample: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
                                            mapper_text: str | None, args: list[str], expected: str) -> None:
    extra = list(args)
    if mapper_text is not None:
        (tmp_path / "m.py").write_text(mapper_text)
        extra += ["--mapper", str(tmp_path / "m.py")]
    elif "missing.py" in extra:
        extra[extra.index("missing.py")] = str(tmp_path / "missing.py")
    assert main(["convert", str(llama_sample), str(tmp_path / "out"), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("workbench convert: ") and expected in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_busy_destination_and_missing_source(llama_sample: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    assert main(["convert", str(llama_sample), str(tmp_path / "out")]) == 2
    assert "destination not empty" in capsys.readouterr().err
    assert main(["plan", str(tmp_path / "nowhere")]) == 2
    assert "no such file or folder" in capsys.readouterr().err
