"""`CannotRead`: one wording for every reader's 'Cannot read ...' error."""

from __future__ import annotations

import ast
from pathlib import Path

from workbench.errors import CannotRead, CheckpointError
from workbench.formats import atorch, dcp, safetensors, torch_zip

FORMATS = Path(__file__).resolve().parents[2] / "workbench" / "formats"


def test_cannot_read_message_names_the_file_and_the_entry() -> None:
    fail = CannotRead("DCP checkpoint", "Re-copy it.", entry="entry")
    error = fail("/ck", "a chunk is missing", "model.w")
    assert isinstance(error, CheckpointError)
    assert error.message == "Cannot read DCP checkpoint /ck (entry 'model.w'): a chunk is missing. Re-copy it."
    assert error.file == "/ck" and error.tensor == "model.w"
    plain = fail("/ck", "the metadata is empty", fix="Save it again.")
    assert plain.message == "Cannot read DCP checkpoint /ck: the metadata is empty. Save it again." and plain.tensor is None


def test_every_reader_words_its_errors_through_cannot_read() -> None:
    assert str(safetensors._fail("m.safetensors", "bad", "w")).startswith("Cannot read safetensors file m.safetensors (tensor 'w'): bad.")
    assert str(dcp._fail("ck", "bad", "w")).startswith("Cannot read DCP checkpoint ck (entry 'w'): bad.")
    assert str(atorch._fail("ck", "bad")).startswith("Cannot read atorch checkpoint ck: bad.")
    assert str(torch_zip._zip_fail("m.pt", "bad")).startswith("Cannot read torch.save file m.pt: bad. The file is truncated")
    defined = []
    for path in sorted(FORMATS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef) and ast.unparse(node.returns or ast.Constant(None)) == "CheckpointError":
                defined.append(f"{path.name}:{node.name}")
    assert defined == []  # no reader keeps a private copy of the helper
