"""The hostile-input corpus, across formats: each crafted checkpoint has one expected outcome.

Every case also goes through the reader contract of the fuzz tests (only WorkbenchError escapes, no
file outside the folder opened, no read past a file's end, bytes read and memory bounded by the file
size), and no payload ever runs. Writing is covered too: tied, non-contiguous, zero-size and 0-d
tensors through `save_tensors` and through `wb.convert` of a torch file.
"""

from __future__ import annotations

import ast
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hostile.corpus import CASES, COVERED_ELSEWHERE, RunsCommand
from hostile.fuzzing import check_reader
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import load_file

import workbench as wb
from tests.conftest import REPO, output_names
from workbench.formats import open_catalog
from workbench.output.safetensors import save_tensors

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.mark.serial  # bounds each case's wall time (30 s): a memory bomb takes ~10 s alone, 30+ s beside other tests
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hostile_input_has_its_expected_outcome(tmp_path: Path, case) -> None:
    folder, marker = tmp_path / "ck", tmp_path / "PWNED"
    folder.mkdir()
    path = case.build(folder, marker)
    started = time.perf_counter()
    outcome = check_reader(path, folder)
    assert time.perf_counter() - started < 30
    assert not marker.exists(), "a payload ran"
    if case.expect == "refused":
        assert not outcome.accepted, f"accepted: {case.name}"
        assert case.says in outcome.error, outcome.error
    else:
        assert outcome.accepted, outcome.error
        catalog = open_catalog(path)
        case.check(catalog)
        catalog.reader.close()
    assert not marker.exists()


def test_cases_covered_by_other_modules_still_exist() -> None:
    for where in COVERED_ELSEWHERE.values():
        file, _, function = where.partition("::")
        tree = ast.parse((REPO / "tests" / file).read_text())
        assert function in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}, where


def test_extras_linked_outside_the_folder_are_never_copied(tmp_path: Path) -> None:
    folder = tmp_path / "ck"
    folder.mkdir()
    save_numpy({"w": np.ones(2, np.float32)}, str(folder / "model.safetensors"))
    (tmp_path / "secret.txt").write_text("private key")
    os.symlink(tmp_path / "secret.txt", folder / "config.json")
    (folder / "tokenizer.json").write_text("{}")
    catalog = open_catalog(folder)
    assert catalog.extras == ["tokenizer.json"]
    wb.convert(folder, tmp_path / "out", quiet=True)
    assert sorted(os.listdir(tmp_path / "out")) == [".workbench-complete.json", "model.safetensors", "tokenizer.json"]


def test_save_tensors_writes_tied_non_contiguous_zero_size_and_scalar_tensors(tmp_path: Path) -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tensors = {
        "tied.a": base, "tied.b": base,  # one storage, two names
        "transposed": base.t(), "strided": base[:, ::2], "expanded": torch.ones(3)[None].expand(2, 3),
        "offset_view": base[1:3], "empty": torch.zeros(0, 5), "scalar": torch.tensor(3.5, dtype=torch.bfloat16),
    }
    path = save_tensors(tmp_path / "model.safetensors", tensors)
    loaded = load_file(str(path))
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor.contiguous()), name
    assert loaded["tied.a"].data_ptr() != loaded["tied.b"].data_ptr()  # stored as two copies, like HF expects


def test_convert_of_a_torch_file_with_tied_strided_and_tiny_tensors(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    embed = torch.randn(8, 4)
    state = {
        "embed.weight": embed, "lm_head.weight": embed,  # tied
        "proj.weight": torch.randn(4, 6).t(),  # non-contiguous view
        "rows": torch.randn(10, 4)[2:7],  # view at a storage offset
        "scale": torch.tensor(0.5), "empty": torch.zeros(0, 4, dtype=torch.float16),
        "extra": {"hook": RunsCommand(marker)},
    }
    torch.save(state, tmp_path / "model.pt")
    report = wb.convert(tmp_path / "model.pt", tmp_path / "out", quiet=True, verify=True)
    assert report.verified and not marker.exists()
    loaded = load_file(str(tmp_path / "out" / "model.safetensors"))
    expected = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    assert set(loaded) == set(expected)
    for name, tensor in expected.items():
        assert loaded[name].shape == tensor.shape and torch.equal(loaded[name], tensor.contiguous()), name


def test_subfolder_extras_never_escape_the_source_folder(tmp_path: Path) -> None:
    folder = tmp_path / "ck"
    (folder / "tok" / "sub").mkdir(parents=True)
    save_numpy({"w": np.ones(2, np.float32)}, str(folder / "model.safetensors"))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "id_rsa").write_text("private key")
    os.symlink(outside, folder / "linked_out")  # a folder link leading outside
    os.symlink(outside / "id_rsa", folder / "tok" / "vocab.txt")  # a file link leading outside
    os.symlink(folder, folder / "tok" / "sub" / "loop")  # a link back up: no endless walk
    os.mkfifo(folder / "tok" / "pipe")
    (folder / "tok" / "merges.txt").write_text("a b\n")
    os.symlink("merges.txt", folder / "tok" / "inside.txt")  # a link that stays inside is copied
    plan = wb.plan(folder, dest=tmp_path / "out")
    table = plan.extras_table.set_index("path")
    assert table.loc["linked_out", "reason"] == table.loc["tok/vocab.txt", "reason"] == "a link leading outside the source folder"
    assert table.loc["tok/pipe", "reason"] == "not a regular file"
    assert table.loc["tok/sub/loop", "action"] == "skip"
    assert plan.extras == ["tok/inside.txt", "tok/merges.txt"]
    wb.convert(folder, tmp_path / "out", quiet=True)
    out = tmp_path / "out"
    assert output_names(out) == ["model.safetensors", "tok"]
    assert sorted(os.listdir(out / "tok")) == ["inside.txt", "merges.txt"]
    assert (out / "tok" / "inside.txt").read_text() == "a b\n" and not (out / "tok" / "inside.txt").is_symlink()


def test_a_planted_destination_subfolder_link_is_not_followed(tmp_path: Path) -> None:
    folder = tmp_path / "ck"
    (folder / "1_Pooling").mkdir(parents=True)
    save_numpy({"w": np.ones(2, np.float32)}, str(folder / "model.safetensors"))
    (folder / "1_Pooling" / "config.json").write_text("{}")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    dest = tmp_path / "out"
    dest.mkdir()
    os.symlink(elsewhere, dest / "1_Pooling")
    with pytest.raises(wb.WorkbenchError, match="1_Pooling exists and is not a folder"):
        wb.convert(folder, dest, overwrite=True, quiet=True)
    assert os.listdir(elsewhere) == []
    assert ".workbench-convert.json" in os.listdir(dest)  # still marked unfinished, never presented as complete
