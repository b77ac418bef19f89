"""Page-congruent outputs: header padding puts each file's data start where its kernel copies move whole pages.

The padding is trailing spaces in the JSON header, which the safetensors format allows; the tests check
that the copies really become congruent, that every reader still loads the files (safetensors, the
workbench, transformers through the HF index), that the header is otherwise the reference writer's,
and that the bytes do not depend on the number of processes or the hash seed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import workbench as wb
from tests.conftest import assert_same_folder, load_safetensors_folder
from workbench.catalog import TensorInfo
from workbench.explore.verify import verify
from workbench.output.safetensors import PAGE, layout_file
from workbench.planning.page_align import ALIGN_MIN_BYTES

ROWS = 256  # a 256 x 1024 F32 tensor is 1 MiB: enough bytes that the planner pads


def _header(path: Path) -> tuple[int, bytes]:
    """(data start, JSON bytes including the padding) of a safetensors file."""
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        return 8 + n, fh.read(n)


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory) -> Path:
    """Two save_file shards of 1 MiB tensors whose headers end at different offsets within a page."""
    import torch
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("src")
    gen = torch.Generator().manual_seed(0)
    weight_map = {}
    for k, names in enumerate([["a.0", "a.1", "a.2"], ["b.0.with_a_longer_name", "b.1.with_a_longer_name", "b.2.with_a_longer_name"]]):
        shard = f"model-{k + 1:05d}-of-00002.safetensors"
        save_file({n: torch.randn(ROWS, 1024, generator=gen) for n in names}, folder / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, shard))
    index = {"metadata": {"total_size": 6 * ROWS * 1024 * 4}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    starts = {_header(folder / f)[0] % PAGE for f in set(weight_map.values())}
    assert len(starts) == 2  # the two sources' data starts differ within a page
    return folder


def _tensor_starts(folder: Path) -> dict[str, tuple[int, int]]:
    """Tensor name -> (absolute file offset, byte length), read from the raw headers of a folder's safetensors files."""
    starts = {}
    for name in sorted(n for n in os.listdir(folder) if n.endswith(".safetensors")):
        start, body = _header(folder / name)
        for key, entry in json.loads(body).items():
            if key != "__metadata__":
                first, last = entry["data_offsets"]
                starts[key] = (start + first, last - first)
    return starts


def _congruent_fraction(source: Path, dest: Path) -> float:
    """Share of the output's tensor bytes whose source and destination offsets agree modulo the page size."""
    src, out = _tensor_starts(source), _tensor_starts(dest)
    good = sum(n for key, (at, n) in out.items() if (src[key][0] - at) % PAGE == 0)
    return good / sum(n for _, n in out.values())


def test_layout_padding_places_the_data_start_and_keeps_the_reference_header() -> None:
    tensors = [TensorInfo("w", "F32", (4, 4)), TensorInfo("b", "BF16", (3,))]
    minimal = layout_file("m.safetensors", tensors)
    for residue in (0, 8, 264, PAGE - 8):
        padded = layout_file("m.safetensors", tensors, data_residue=residue)
        assert len(padded.header) % PAGE == residue and len(padded.header) < len(minimal.header) + PAGE
        assert padded.header[8:].rstrip(b" ") == minimal.header[8:].rstrip(b" ")  # only spaces were added
        assert [t.begin - len(padded.header) for t in padded.tensors] == [t.begin - len(minimal.header) for t in minimal.tensors]
        seen = []
        chosen = layout_file("m.safetensors", tensors, data_residue=lambda offsets, seen=seen, residue=residue: seen.append(offsets) or residue)
        assert chosen == padded and seen == [{t.name: t.begin - len(minimal.header) for t in minimal.tensors}]
    assert layout_file("m.safetensors", tensors, data_residue=lambda offsets: None) == minimal
    with pytest.raises(ValueError, match="multiple of 8"):
        layout_file("m.safetensors", tensors, data_residue=12)
    with pytest.raises(ValueError, match="multiple of 8"):
        layout_file("m.safetensors", tensors, data_residue=lambda offsets: 12)


def test_each_output_file_starts_its_data_congruent_with_its_source(two_sources: Path, tmp_path: Path) -> None:
    from safetensors import safe_open

    dest, plain = tmp_path / "aligned", tmp_path / "plain"
    # Two tensors per output file: [a.0 a.1] [a.2 b.0] [b.1 b.2]; the middle file can align only one of its sources.
    wb.convert(two_sources, dest, shard_size="2200KB", quiet=True)
    wb.convert(two_sources, plain, shard_size="2200KB", quiet=True, page_align=False)
    assert _congruent_fraction(two_sources, dest) == 5 / 6
    assert _congruent_fraction(two_sources, plain) == 0.0  # minimal headers: every copy straddles pages
    expected = load_safetensors_folder(two_sources)
    for name in sorted(n for n in os.listdir(dest) if n.endswith(".safetensors")):
        start, body = _header(dest / name)
        plain_start, plain_body = _header(plain / name)
        assert body.rstrip(b" ") == plain_body.rstrip(b" ") and 8 <= start - plain_start < PAGE + 8
        assert (dest / name).read_bytes()[start:] == (plain / name).read_bytes()[plain_start:]
        with safe_open(dest / name, framework="pt") as fh:
            for key in fh.keys():  # noqa: SIM118 (safe_open is not iterable)
                assert fh.get_tensor(key).equal(expected[key])
    assert json.loads((dest / "model.safetensors.index.json").read_text()) == json.loads((plain / "model.safetensors.index.json").read_text())
    assert verify(dest).ok  # the workbench reader accepts the padded headers too


def test_one_file_from_two_sources_aligns_the_larger_share(two_sources: Path, tmp_path: Path) -> None:
    """Tensors in a file are contiguous, so only one source's runs can be congruent: the one with more bytes."""
    import torch
    from safetensors.torch import load_file

    dest = tmp_path / "one"
    plan = wb.plan(two_sources, dest=dest)  # 5GB: everything in model.safetensors
    assert [f.name for f in plan.output_file_list] == ["model.safetensors"]
    wb.convert(two_sources, dest, quiet=True)
    assert _congruent_fraction(two_sources, dest) == 0.5  # 3 of 6 equal tensors: the first source's, on a tie
    loaded = load_file(dest / "model.safetensors")
    assert all(torch.equal(loaded[k], v) for k, v in load_safetensors_folder(two_sources).items())


def test_without_page_align_or_below_the_threshold_the_bytes_equal_save_file(two_sources: Path, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    expected = load_safetensors_folder(two_sources)
    wb.convert(two_sources, tmp_path / "plain", quiet=True, page_align=False)
    save_file(expected, tmp_path / "reference.safetensors", metadata={"format": "pt"})
    assert (tmp_path / "plain" / "model.safetensors").read_bytes() == (tmp_path / "reference.safetensors").read_bytes()
    # Small copies (< ALIGN_MIN_BYTES per file) keep the reference header even with page_align on.
    small = tmp_path / "small"
    small.mkdir()
    save_file({"w": torch.ones(ALIGN_MIN_BYTES // 8)}, small / "model.safetensors")
    wb.convert(small, tmp_path / "small_out", quiet=True)
    save_file({"w": torch.ones(ALIGN_MIN_BYTES // 8)}, tmp_path / "small_ref.safetensors", metadata={"format": "pt"})
    assert (tmp_path / "small_out" / "model.safetensors").read_bytes() == (tmp_path / "small_ref.safetensors").read_bytes()


def test_casts_and_computed_outputs_keep_the_minimal_header(two_sources: Path, tmp_path: Path) -> None:
    """Nothing is kernel-copied in a cast, so nothing is gained by padding: the file equals save_file's."""
    from safetensors.torch import save_file

    dest = tmp_path / "bf16"
    wb.convert(two_sources, dest, dtype="bf16", quiet=True)
    expected = {k: v.bfloat16() for k, v in load_safetensors_folder(two_sources).items()}
    save_file(expected, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    assert (dest / "model.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


@pytest.mark.distributed
def test_padded_bytes_are_the_same_for_any_nproc_and_hash_seed(two_sources: Path, tmp_path: Path) -> None:
    one, two, seeded = tmp_path / "one", tmp_path / "two", tmp_path / "seeded"
    wb.convert(two_sources, one, shard_size="2200KB", quiet=True)
    wb.convert(two_sources, two, shard_size="2200KB", quiet=True, nproc=2, launcher="local")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    subprocess.run([sys.executable, "-m", "workbench", "convert", str(two_sources), str(seeded), "--shard-size", "2200KB", "--quiet"],
                   check=True, env=env, capture_output=True)
    assert_same_folder(one, two)
    assert_same_folder(one, seeded)
    padded = [n for n in os.listdir(one) if n.endswith(".safetensors") and _header(one / n)[1].endswith(b" " * 8)]
    assert padded  # the comparison covers padded files, not only minimal ones


def test_transformers_loads_a_padded_sharded_llama(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    import torch

    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                                      num_hidden_layers=2, vocab_size=1024, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    source, dest = tmp_path / "src", tmp_path / "out"
    model.save_pretrained(source, max_shard_size="2MB")
    wb.convert(source, dest, shard_size="1500KB", quiet=True)
    padded = [n for n in os.listdir(dest) if n.endswith(".safetensors") and _header(dest / n)[1].endswith(b" " * 8)]
    assert padded and (dest / "model.safetensors.index.json").exists()
    loaded = transformers.LlamaForCausalLM.from_pretrained(dest)
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name


def test_an_interrupted_padded_conversion_resumes_keeping_its_finished_files(two_sources: Path, tmp_path: Path, monkeypatch) -> None:
    from workbench.engine.rank import FAIL_RANK_ENV
    from workbench.errors import PlanError

    clean, dest = tmp_path / "clean", tmp_path / "resumed"
    wb.convert(two_sources, clean, shard_size="2200KB", quiet=True)
    monkeypatch.setenv(FAIL_RANK_ENV, "0")  # fail just before the last file's commit
    with pytest.raises(PlanError, match="failure injected"):
        wb.convert(two_sources, dest, shard_size="2200KB", quiet=True)
    monkeypatch.delenv(FAIL_RANK_ENV)
    report = wb.convert(two_sources, dest, shard_size="2200KB", quiet=True)
    assert sorted(report.kept) == ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors"]
    assert _header(dest / "model-00001-of-00003.safetensors")[1].endswith(b" " * 8)  # a kept file is a padded one
    assert_same_folder(clean, dest)


def test_a_raw_in_place_reader_gives_the_offsets_locate_gives(two_sources: Path) -> None:
    """Safetensors tensors lie raw at their `begin`: the planner reads that instead of asking `locate` per tensor."""
    from workbench.formats import open_catalog
    from workbench.planning.page_align import raw_begin, reader_offsets

    catalog = open_catalog(two_sources)
    offset = reader_offsets(catalog.reader)
    assert offset is raw_begin
    assert [offset(info) for info in catalog.tensors.values()] == [catalog.reader.locate(info)[1] for info in catalog.tensors.values()]
