"""What the GGUF and Meta `.pth` writers read from an untrusted source folder (issue 29: B1, C2, D2).

- B1: every file they read (config.json, generation_config.json, the tokenizer files) follows the link rule of
  extras: a link out of the folder is refused naming it, never read into the output; sizes are bounded.
- C2: hostile values (deep nesting, wrong JSON types, sizes GGUF cannot hold, NaN) are WorkbenchErrors naming
  the file and the key, in Python and as the CLI's exit 2, never internal errors nor values copied.
- D2: a relative source path gives the same bytes as the absolute one (and llama.cpp's converter).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
from gguf_support.reference import model_folder, reference_gguf

import workbench as wb
from workbench.cli.commands import main as cli_main
from workbench.errors import PlanError, WorkbenchError

gguf = pytest.importorskip("gguf")

FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _copy(tmp_path: Path, family: str = "llama", name: str = "src", tokenizer: str | None = None) -> Path:
    """A private copy of the fixture folder (its files, no links)."""
    src = model_folder(family, tokenizer)
    folder = tmp_path / name
    folder.mkdir(parents=True)
    for entry in src.iterdir():
        if entry.is_file():
            shutil.copyfile(entry, folder / entry.name)
    return folder


def _edit_config(folder: Path, **changes: object) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


# B1: links out of the folder --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json",
                                  "generation_config.json", "tokenizer.model"])
def test_a_source_file_linked_outside_the_folder_is_refused_not_read(tmp_path: Path, name: str) -> None:
    folder = _copy(tmp_path)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    original = folder / name
    if name == "tokenizer.model":  # a SentencePiece model planted as a link: the route that reads it must not follow it
        shutil.copyfile(model_folder("llama", "spm") / name, outside / name)
    elif original.exists():
        shutil.move(original, outside / name)
    else:
        (outside / name).write_text(json.dumps({"temperature": 0.5}))
    original.symlink_to(outside / name)
    with pytest.raises(PlanError, match=rf"Cannot read {folder / name}: it is a link to .*outside the source folder"):
        wb.plan(folder, to="gguf", dtype="f16")
    assert cli_main(["convert", str(folder), str(tmp_path / "out"), "--to", "gguf"]) == 2
    assert not (tmp_path / "out" / "model.gguf").exists()


def test_pth_refuses_a_config_linked_outside_the_folder(tmp_path: Path) -> None:
    folder = _copy(tmp_path)
    (tmp_path / "config.json").write_bytes((folder / "config.json").read_bytes())
    (folder / "config.json").unlink()
    (folder / "config.json").symlink_to(tmp_path / "config.json")
    with pytest.raises(PlanError, match="config.json: it is a link to .*outside the source folder"):
        wb.plan(folder, to="pth")


def test_hub_cache_snapshot_links_into_blobs_are_still_read(tmp_path: Path) -> None:
    """The one layout whose links leave the folder (formats/links.py): a Hub cache snapshot's links into blobs/."""
    repo = tmp_path / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for entry in model_folder("llama").iterdir():
        if entry.is_file():
            shutil.copyfile(entry, repo / "blobs" / entry.name)
            (snapshot / entry.name).symlink_to(Path("../../blobs") / entry.name)
    plan = wb.plan(snapshot, to="gguf", dtype="f16")
    kv = dict(plan.output_file_list[0].layout.kv)
    assert plan.ok and kv["tokenizer.ggml.bos_token_id"] == 1 and kv["tokenizer.ggml.eos_token_id"] == 2


def test_source_files_are_bounded_in_size_and_kind(tmp_path: Path) -> None:
    from workbench.output import source_files

    folder = _copy(tmp_path)
    with open(folder / "generation_config.json", "w") as fh:  # a JSON config above the 16 MiB bound
        fh.write("{" + " " * source_files.CONFIG_LIMIT + "}")
    with pytest.raises(PlanError, match=rf"generation_config.json: it holds {source_files.CONFIG_LIMIT + 2} bytes, more than the "
                                        rf"{source_files.CONFIG_LIMIT}"):
        wb.plan(folder, to="gguf")
    (folder / "generation_config.json").unlink()
    os.mkfifo(folder / "generation_config.json")  # would block a plain open() for ever
    with pytest.raises(PlanError, match="generation_config.json: it is not a regular file"):
        wb.plan(folder, to="gguf")
    assert source_files.TOKENIZER_LIMIT == 128 << 20 and source_files.limit_of("tokenizer.json") == source_files.TOKENIZER_LIMIT


# C2: hostile values -----------------------------------------------------------------------------------------------

def _nested(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


CONFIG_CASES = [
    ({"hidden_size": 10**12}, "hidden_size is 1000000000000, outside 1..2147483647"),
    ({"vocab_size": 10**12}, "vocab_size is 1000000000000, outside 1..4194304"),
    ({"rms_norm_eps": "x"}, "rms_norm_eps is 'x', not a number"),
    ({"rope_theta": math.nan}, "rope_theta is nan, not finite"),
    ({"num_attention_heads": True}, "num_attention_heads is True, not a whole number"),
    ({"rope_scaling": "garbage"}, "rope_scaling is 'garbage', not an object"),
    ({"rope_parameters": ["garbage"]}, r"rope_parameters is \['garbage'\], not an object"),
    ({"rope_parameters": {"rope_type": "linear", "factor": math.inf}}, r"rope_parameters.factor is inf, not finite"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": math.nan}}, r"rope_parameters.rope_theta is nan, not finite"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": "fast"}}, r"rope_scaling.beta_fast is 'fast', not a number"),
    ({"rope_parameters": {"full_attention": {"rope_theta": -1.0}}}, r"rope_parameters.full_attention.rope_theta is -1.0, not positive"),
    ({"max_position_embeddings": -1}, "max_position_embeddings is -1, outside"),
]


@pytest.mark.parametrize(("changes", "message"), CONFIG_CASES)
@pytest.mark.parametrize("to", ["gguf", "pth"])
def test_config_values_no_model_has_are_refused_naming_the_key(tmp_path: Path, changes: dict, message: str, to: str) -> None:
    folder = _copy(tmp_path)
    _edit_config(folder, **changes)
    with pytest.raises(PlanError, match=rf"Cannot use {folder / 'config.json'}: {message}"):
        wb.plan(folder, to=to)


def test_pth_with_a_nan_hidden_size_exits_2_with_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _copy(tmp_path)
    _edit_config(folder, hidden_size=math.nan)
    assert cli_main(["convert", str(folder), str(tmp_path / "out"), "--to", "pth"]) == 2
    err = capsys.readouterr().err
    assert "hidden_size is nan, not a whole number" in err and "internal error" not in err
    assert not (tmp_path / "out" / "params.json").exists()


@pytest.mark.parametrize("to", ["gguf", "pth"])
def test_a_config_nested_100k_deep_is_refused(tmp_path: Path, to: str) -> None:
    folder = _copy(tmp_path)
    (folder / "config.json").write_text(_nested(100_000))
    with pytest.raises(WorkbenchError, match="config.json"):
        wb.plan(folder, to=to)
    (folder / "config.json").write_text(json.dumps({**json.loads((model_folder("llama") / "config.json").read_text()),
                                                    "x": json.loads(_nested(100))}))
    with pytest.raises(PlanError, match="config.json: its JSON nests more than 64 levels deep"):
        wb.plan(folder, to=to)


TOKENIZER_CASES = [
    ("[" * 100_000 + "]" * 100_000, "tokenizer.json: its JSON nests more than 64 levels deep"),
    (lambda t: {**t, "model": {**t["model"], "vocab": list(t["model"]["vocab"])}}, r"tokenizer.json: model.vocab is list, not an object"),
    (lambda t: {**t, "model": [1, 2]}, r"tokenizer.json: model is list, not an object"),
    (lambda t: {**t, "added_tokens": [{"id": 10**15, "content": "<s>"}]}, r"tokenizer.json: added_tokens\[0\]"),
    (lambda t: {**t, "post_processor": {"type": "TemplateProcessing", "single": [5, 6]}}, "Cannot read the tokenizer files of"),
]


@pytest.mark.parametrize(("change", "message"), TOKENIZER_CASES)
def test_a_tokenizer_no_model_has_is_refused_naming_the_file(tmp_path: Path, change: object, message: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    folder = _copy(tmp_path)
    if isinstance(change, str):
        (folder / "tokenizer.json").write_text(change)
    else:
        (folder / "tokenizer.json").write_text(json.dumps(change(json.loads((folder / "tokenizer.json").read_text()))))
    with pytest.raises(PlanError, match=message):
        wb.plan(folder, to="gguf")
    assert cli_main(["plan", str(folder), "--to", "gguf"]) == 2
    assert "internal error" not in capsys.readouterr().err


def test_valid_config_values_still_give_the_converters_bytes(tmp_path: Path) -> None:
    """The checks refuse only what no model has: the reference folder converts to llama.cpp's bytes."""
    wb.convert(model_folder("llama"), tmp_path / "out", to="gguf", dtype="f16", quiet=True)
    assert (tmp_path / "out" / "model.gguf").read_bytes() == reference_gguf("llama", "f16").read_bytes()


# D2: a relative source path ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("family", "outtype"), [("llama", "f16"), ("qwen2", "q8_0")])
def test_a_relative_source_path_gives_the_converters_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str,
                                                           outtype: str) -> None:
    """Same folder name as the fixture (general.name comes from it), given relative to the working directory, from
    Python and from the CLI: special token ids and chat template included, byte-identical to llama.cpp's file."""
    src = model_folder(family)
    _copy(tmp_path / "models", family, src.name)
    monkeypatch.chdir(tmp_path)
    reference = reference_gguf(family, outtype).read_bytes()
    wb.convert(f"models/{src.name}", "py", to="gguf", dtype=outtype, quiet=True)
    assert cli_main(["convert", f"models/{src.name}", "cli", "--to", "gguf", "--dtype", outtype]) == 0
    for out in ("py", "cli"):
        written = tmp_path / out / "model.gguf"
        assert written.read_bytes() == reference, out
    if family == "llama":  # (gguf-py's reader takes a minute over Qwen2's 151k tokens: the bytes say the same)
        fields = gguf.GGUFReader(tmp_path / "py" / "model.gguf").fields
        assert {"tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id"} <= set(fields)


def test_chat_templates_reach_the_file_from_a_relative_path_as_the_converter_writes_them(tmp_path: Path,
                                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """chat_template.jinja and additional_chat_templates/*.jinja (read by gguf's SpecialVocab from the staged copy),
    from a relative path: the same bytes as llama.cpp's converter run on the same folder."""
    from gguf_support.reference import _run_converter, converter

    folder = _copy(tmp_path, name="chat")
    (folder / "chat_template.jinja").write_text("{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}")
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "tool_use.jinja").write_text("{{ tools }}")
    monkeypatch.chdir(tmp_path)
    wb.convert("chat", "out", to="gguf", dtype="f16", quiet=True)
    _run_converter(converter(), folder, "f16", tmp_path / "reference.gguf")
    fields = gguf.GGUFReader(tmp_path / "out" / "model.gguf").fields
    assert fields["tokenizer.chat_template"].contents().startswith("{% for m in messages %}")
    assert fields["tokenizer.chat_template.tool_use"].contents() == "{{ tools }}"
    assert (tmp_path / "out" / "model.gguf").read_bytes() == (tmp_path / "reference.gguf").read_bytes()
