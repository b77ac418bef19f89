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


# What a byte-copy `workbench convert` process must not import: tensor libraries, the pandas tables, the mapper
# family presets (the `presets` package itself only names them) and GGUF layout (an output format's preset is imported when that format is written), the other output
# formats' writers and the GGUF row code (imported on first use), the training-checkpoint readers (imported when
# a path could be theirs: `formats.__init__`), and the standard
# library's package metadata reader (the RSS calibration check reads dist-info folder names instead). Each is
# start-up time that a copy measured against `cp -r` pays on every run (benchmarks/paired.py).
NOT_IMPORTED_BY_A_BYTE_COPY = ("torch", "numpy", "pandas", "workbench.mapper.presets.layouts", "workbench.mapper.presets.gguf_preset",
                               "workbench.mapper.ops", "importlib.metadata", "concurrent.futures", "csv",
                               "workbench.output.gguf", "workbench.output.dcp", "workbench.output.pth",
                               "workbench.mapper.presets.gguf_rows", "workbench.formats.dcp", "workbench.formats.deepspeed",
                               "workbench.formats.megatron", "workbench.formats.atorch", "workbench.formats.meta_pth",
                               "workbench.formats.torch_folder", "workbench.formats.torch_zip", "workbench.formats.gguf",
                               "workbench.formats.pickle")


def test_a_byte_copy_convert_imports_only_what_it_uses(llama_sample: Path, tmp_path: Path) -> None:
    dest = tmp_path / "out"
    code = (
        "import json, sys\nfrom workbench.cli import main\n"
        f"rc = main(['convert', {str(llama_sample)!r}, {str(dest)!r}, '--shard-size', '300KB', '--quiet'])\n"
        f"print('EXIT', rc, json.dumps(sorted(m for m in {NOT_IMPORTED_BY_A_BYTE_COPY!r} if m in sys.modules)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "EXIT 0 []" in done.stdout, done.stdout[-2000:]
    assert "byte copies only" in done.stdout and "files opened match the plan: yes" in done.stdout
    assert len(open_catalog(dest)) == len(open_catalog(llama_sample))


def test_a_preset_conversion_reads_the_source_headers_once(llama_sample: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import workbench.formats as formats

    opened = []
    real = formats.open_catalog
    monkeypatch.setattr(formats, "open_catalog", lambda path, **options: opened.append(path) or real(path, **options))
    dest = tmp_path / "out"
    assert main(["convert", str(llama_sample), str(dest), "--preset", "hf_to_fused", "--quiet"]) == 0
    assert opened == [str(llama_sample)]  # by the preset; the plan takes its catalog
    assert "model.layers.0.self_attn.qkv_proj.weight" in open_catalog(dest)


def test_plan_command_prints_the_dry_run(llama_sample: Path, mapper_file: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", str(llama_sample), "--mapper", str(mapper_file), "--shard-size", "300KB", "--nproc", "2"]) == 0
    out = capsys.readouterr().out
    assert "status: OK" in out and "ranks: 2" in out and "model-00003-of-00003.safetensors" in out


def test_dry_run_cast_and_no_extras(llama_sample: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    dest = tmp_path / "out"
    assert main(["convert", str(llama_sample), str(dest), "--dtype", "bf16", "--dry-run"]) == 0
    assert "casts by numpy" in capsys.readouterr().out and not dest.exists()
    assert main(["convert", str(llama_sample), str(dest), "--dtype", "bf16", "--no-extras", "--quiet"]) == 0
    assert sorted(os.listdir(dest)) == [".workbench-complete.json", "model.safetensors"]  # and the completion record
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


# -- mapper files: Functions defined next to the mapper, and mappers read from a pipe ---------------------------
FUNCTION_MAPPER = """from workbench import mapper as M
from neighbour import negate


def double(tensor):
    return tensor * 2


mapper = M.Parallel(
    M.Function(fn="doubling:double", inputs=["model.norm.weight"], outputs=["model.norm.weight_x2"]),
    M.Function(fn="neighbour:negate", inputs=["model.layers.0.input_layernorm.weight"],
               outputs=["model.layers.0.input_layernorm.negated"]),
)
"""


def write_function_mapper(folder: Path) -> Path:
    """`doubling.py` defines a Function's callable itself; another one lives in `neighbour.py` next to it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "neighbour.py").write_text("def negate(tensor):\n    return -tensor\n")
    path = folder / "doubling.py"
    path.write_text(FUNCTION_MAPPER)
    return path


def check_function_outputs(source: Path, dest: Path) -> None:
    from tests.conftest import load_safetensors_folder

    before, after = load_safetensors_folder(source), load_safetensors_folder(dest)
    assert (after["model.norm.weight_x2"] == before["model.norm.weight"] * 2).all()
    assert (after["model.layers.0.input_layernorm.negated"] == -before["model.layers.0.input_layernorm.weight"]).all()


def run_cli(args: list[str], cwd: Path, **kwargs) -> subprocess.CompletedProcess:
    """`python -m workbench ...` elsewhere than the mapper's folder, with PYTHONPATH as the tests have it (no mapper folder)."""
    return subprocess.run([sys.executable, "-m", "workbench", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300, **kwargs)


def test_function_defined_in_the_mapper_file_needs_no_pythonpath(llama_sample: Path, tmp_path: Path) -> None:
    mapper = write_function_mapper(tmp_path / "mappers")
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    done = run_cli(["convert", str(llama_sample), str(tmp_path / "out"), "--mapper", str(mapper), "--quiet"], elsewhere)
    assert done.returncode == 0, done.stderr[-3000:]
    check_function_outputs(llama_sample, tmp_path / "out")


def test_mapper_from_a_pipe_is_read_once(llama_sample: Path, tmp_path: Path) -> None:
    read, write = os.pipe()  # what `--mapper <(cat m.py)` hands over: /dev/fd/N, a pipe that reads once
    os.write(write, FUSE_GATE_UP.encode())
    os.close(write)
    try:
        done = run_cli(["plan", str(llama_sample), "--mapper", f"/dev/fd/{read}"], tmp_path, pass_fds=(read,))
    finally:
        os.close(read)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "status: OK" in done.stdout and "outputs: 35 tensors" in done.stdout  # 4 layers fused: 39 -> 35


def test_mapper_from_a_fifo_and_a_directory(llama_sample: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import threading

    fifo = tmp_path / "mapper.fifo"
    os.mkfifo(fifo)

    def feed() -> None:
        with open(fifo, "w") as handle:
            handle.write(FUSE_GATE_UP)

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    try:
        assert main(["plan", str(llama_sample), "--mapper", str(fifo)]) == 0
    finally:
        if writer.is_alive():  # the loader never opened the FIFO: open it here so the writer can finish
            reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
            writer.join(timeout=10)
            os.close(reader)
    assert "outputs: 35 tensors" in capsys.readouterr().out
    assert main(["plan", str(llama_sample), "--mapper", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "is a directory, not a regular file" in err and "no such file" not in err


def test_a_finished_conversion_is_only_the_same_if_its_functions_code_is(llama_sample: Path, tmp_path: Path) -> None:
    mapper = write_function_mapper(tmp_path / "mappers")
    command = ["convert", str(llama_sample), str(tmp_path / "out"), "--mapper", str(mapper), "--quiet"]
    assert run_cli(command, tmp_path).returncode == 0
    again = run_cli(command, tmp_path)
    assert again.returncode == 0 and "Already complete, nothing to do" in again.stdout
    (tmp_path / "mappers" / "neighbour.py").write_text("def negate(tensor):\n    return -2 * tensor\n")  # same names, new code
    changed = run_cli(command, tmp_path)
    assert changed.returncode == 2 and "finished conversion of a different plan" in changed.stderr
    check_function_outputs(llama_sample, tmp_path / "out")  # untouched
