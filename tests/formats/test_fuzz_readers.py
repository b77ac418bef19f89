"""Fuzzing every reader: mutated bytes may be refused, never crash, escape the folder or allocate wildly.

Each target is a small valid checkpoint (`hostile.seeds`); hypothesis draws a few byte edits of one of
its files (safetensors header, HF index JSON, torch zip, the pickle inside it, DCP `.metadata` and data,
atorch pickles) and `hostile.fuzzing.check_reader` asserts the contract: only `WorkbenchError`
escapes, no file outside the folder is opened, no read runs past the end of a file, bytes read and
memory (tracemalloc peak) stay within a fixed multiple of the checkpoint's
size. Runs are derandomized (the same inputs every time) and bounded to a few seconds per target;
`benchmarks/fuzz_long.py --minutes N` explores further with fresh random inputs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from hostile.fuzzing import apply_mutations, check_reader, mutations
from hostile.seeds import INDEX_NAME, TARGETS, build_seed
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from workbench.dtypes import DTYPE_BITS
from workbench.errors import CheckpointError
from workbench.formats.safetensors import read_header

# Examples per target, sized so that the whole module runs in about half a minute on two cores.
EXAMPLES = {
    "safetensors": 400,
    "hf-index": 250,
    "gguf": 250,
    "torch-zip": 250,
    "torch-pickle": 200,
    "torch-pickle-deflated": 120,
    "dcp-metadata": 120,
    "dcp-data": 80,
    "atorch-meta": 150,
}
FUZZ_SETTINGS = settings(
    deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck), print_blob=True
)


def test_every_target_is_covered_and_its_seed_is_accepted(tmp_path: Path) -> None:
    assert set(EXAMPLES) == set(TARGETS)
    for name, target in TARGETS.items():
        folder = tmp_path / name
        path, _ = build_seed(target, folder)
        outcome = check_reader(path, folder)
        assert outcome.accepted and outcome.tensors > 0, (name, outcome.error)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_mutated_checkpoints_keep_the_reader_contract(tmp_path: Path, name: str) -> None:
    target = TARGETS[name]
    folder = tmp_path / "ck"
    path, payloads = build_seed(target, folder)
    seen = {"accepted": 0, "refused": 0}

    @settings(FUZZ_SETTINGS, max_examples=EXAMPLES[name])
    @given(st.data())
    def fuzz(data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(target.payloads), label="payload")
        edits = data.draw(mutations(len(payloads[key])), label="edits")
        target.apply(folder, key, apply_mutations(payloads[key], edits))
        try:
            outcome = check_reader(path, folder)
            seen["accepted" if outcome.accepted else "refused"] += 1
        finally:
            target.apply(folder, key, payloads[key])

    fuzz()
    # The mutations must reach past the first check: some inputs are refused, some still read.
    assert seen["refused"] > 0 and seen["accepted"] > 0, seen


# ------------------------------------------------------------------------------------- structured inputs

DTYPES = sorted(DTYPE_BITS)
dims = st.one_of(st.integers(0, 4), st.sampled_from([2**31, 2**32 + 1, 2**62, 2**64, 2**64 + 3, -1]))
entries = st.fixed_dictionaries(
    {
        "dtype": st.one_of(st.sampled_from(DTYPES), st.sampled_from(["F128", "", "bf16"])),
        "shape": st.lists(dims, max_size=4),
        "data_offsets": st.lists(st.one_of(st.integers(0, 64), st.sampled_from([2**63, 2**64, -8])), min_size=2, max_size=2),
    }
)


def reference_accepts(path: Path) -> bool:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            list(f.keys())
    except Exception:
        return False
    return True


@pytest.mark.slow
@settings(FUZZ_SETTINGS, max_examples=250)
@given(header=st.dictionaries(st.text(max_size=8), entries, max_size=5), data_len=st.integers(0, 96))
@example(header={"w": {"dtype": "U8", "shape": [2**62, 2**62, 0], "data_offsets": [0, 0]}}, data_len=0)
@example(header={"w": {"dtype": "F32", "shape": [2**64, 0], "data_offsets": [0, 0]}}, data_len=0)
def test_generated_headers_are_refused_or_tile_the_data_buffer(tmp_path_factory, header: dict, data_len: int) -> None:
    """Shapes whose numel * itemsize overflow 64 bits (a 0 elsewhere or not), offsets past the buffer, unknown
    dtypes: refused, or read exactly; and never accepted when the reference reader refuses the file."""
    path = tmp_path_factory.getbasetemp() / "generated.safetensors"
    body = json.dumps(header).encode()
    path.write_bytes(len(body).to_bytes(8, "little") + body + bytes(data_len))
    try:
        parsed = read_header(path)
    except CheckpointError as exc:
        assert str(path) in str(exc)
        return
    assert reference_accepts(path), f"accepted a header the reference reader refuses: {body[:300]!r}"
    start = parsed.header_bytes
    position = start
    for info in parsed.tensors:  # in data order, contiguous, each exactly numel * itemsize long
        assert info.begin == position and info.end - info.begin == info.nbytes
        position = info.end
    assert position == parsed.file_size == start + data_len


KEYS = ("dtype", "shape", "data_offsets", "__metadata__")


@pytest.mark.slow
@settings(FUZZ_SETTINGS, max_examples=120)
@given(key=st.sampled_from(KEYS), escaped=st.data())
def test_keys_repeated_through_escapes_are_refused(tmp_path_factory, key: str, escaped: st.DataObject) -> None:
    """Any spelling of a repeated key (some of its characters as \\uXXXX escapes) is a repeated key."""
    mask = escaped.draw(st.lists(st.booleans(), min_size=len(key), max_size=len(key)).filter(any), label="escaped chars")
    spelled = "".join(f"\\u{ord(c):04x}" if m else c for c, m in zip(key, mask, strict=True))
    entry = '"dtype": "U8", "shape": [4], "data_offsets": [0, 4]'
    if key == "__metadata__":
        text = '{"__metadata__": {"a": "b"}, "' + spelled + '": {"a": "c"}, "x": {' + entry + "}}"
    else:
        value = {"dtype": '"I8"', "shape": "[2, 2]", "data_offsets": "[0, 4]"}[key]
        text = '{"x": {' + entry + ', "' + spelled + '": ' + value + "}}"
    path = tmp_path_factory.getbasetemp() / "escaped.safetensors"
    path.write_bytes(len(text).to_bytes(8, "little") + text.encode() + bytes(4))
    with pytest.raises(CheckpointError, match=f"repeats the key '{key}'"):
        read_header(path)


shard_names = st.one_of(
    st.sampled_from(["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]),
    st.sampled_from(["../outside.safetensors", "/etc/passwd", "sub/../../outside.safetensors", "link.safetensors",
                     "..", ".", "", "C:\\x.safetensors", "\\\\server\\share", "a\x00b"]),
    st.text(max_size=12),
    st.integers(),
    st.none(),
    st.lists(st.just("model-00001-of-00002.safetensors"), max_size=2),
)


@pytest.mark.slow
@settings(FUZZ_SETTINGS, max_examples=150)
@given(weight_map=st.dictionaries(st.sampled_from(["a.weight", "a.bias", "b.weight", "x", ""]), shard_names, max_size=5))
def test_generated_index_never_opens_a_file_outside_the_folder(tmp_path_factory, weight_map: dict) -> None:
    base = tmp_path_factory.getbasetemp() / "generated-index"
    folder = base / "ck"
    if not folder.exists():
        folder.mkdir(parents=True)
        TARGETS["hf-index"].build(folder)
        save_file({"secret": np.zeros(2, np.float32)}, str(base / "outside.safetensors"))
        os.symlink(base / "outside.safetensors", folder / "link.safetensors")
    (folder / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": 1}, "weight_map": weight_map}))
    outcome = check_reader(folder, folder)  # asserts no file outside `folder` was opened
    if any(v in ("../outside.safetensors", "/etc/passwd", "link.safetensors") for v in weight_map.values()):
        assert not outcome.accepted
