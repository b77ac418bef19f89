"""torch.save zip files: listed without executing their pickle, read equal to torch.load(weights_only=True)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest
import torch

from tests.conftest import REPO, SAMPLES, load_checked
from workbench.errors import CheckpointError
from workbench.formats import open_catalog
from workbench.formats.pickle.unpickler import weights_only_allows
from workbench.iostats import IO

TORCH_SAMPLES = SAMPLES / "training" / "torch"


def flatten(obj, prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else []
    for key, value in items:
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, torch.Tensor):
            out[name] = value
        else:
            out.update(flatten(value, name))
    return out


def assert_matches_torch_load(path) -> None:
    catalog = open_catalog(path)
    expected = flatten(torch.load(path, weights_only=True))
    assert set(catalog.tensors) == set(expected)
    for name, ref in expected.items():
        got = load_checked(catalog, name)
        assert got.dtype == ref.dtype and got.shape == ref.shape, name
        assert torch.equal(got.reshape(-1).view(torch.uint8), ref.contiguous().reshape(-1).view(torch.uint8)), name


def test_sample_state_dict_matches_torch_load_and_shows_shared_storages():
    path = TORCH_SAMPLES / "pytorch_model.bin"
    assert_matches_torch_load(path)
    catalog = open_catalog(path)
    assert catalog.format == "torch" and catalog.metadata["weights_only"] == "yes"
    assert catalog.columns["shared_with"]["embed.weight"] == "lm_head.weight"
    assert catalog.columns["storage"]["proj.weight"] == catalog.columns["storage"]["proj_t.weight"]
    assert catalog.columns["shared_with"]["norm.weight"] == ""
    assert catalog.locate("proj_t.weight") is None  # transposed view: gathered, not a raw range
    assert catalog.locate("proj.weight") is not None


def test_many_dtypes_views_and_nesting(tmp_path):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    obj = {
        "model": {
            "bf16": torch.randn(3, 5).to(torch.bfloat16),
            "f16": torch.randn(7).half(),
            "i8": torch.arange(-4, 4, dtype=torch.int8),
            "mask": torch.tensor([True, False, True]),
            "u16": torch.arange(5, dtype=torch.int32).to(torch.uint16),  # saved via _rebuild_tensor_v3 over an untyped storage
            "fp8": torch.randn(4).to(torch.float8_e4m3fn),
            "scalar": torch.tensor(7, dtype=torch.int64),
            "empty": torch.empty(0, 3),
            "param": torch.nn.Parameter(torch.randn(2, 2)),
        },
        "views": {
            "base": base,
            "rows": base[1:3],
            "every_other": base[:, ::2],
            "transposed": base.t(),
            "expanded": torch.randn(1, 3).expand(4, 3),
        },
        "optimizer": {"state": {0: {"exp_avg": torch.randn(3), "step": torch.tensor(2.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
        "history": [torch.ones(2), (torch.zeros(1), 3)],
    }
    path = tmp_path / "mixed.pt"
    torch.save(obj, path)
    assert_matches_torch_load(path)
    catalog = open_catalog(path)
    assert "optimizer.state.0.exp_avg" in catalog and "history.1.0" in catalog
    assert catalog["model.u16"].dtype == "U16" and catalog["model.fp8"].dtype == "F8_E4M3"
    assert catalog.locate("views.rows") is not None and catalog.locate("views.every_other") is None
    assert set(catalog.columns["shared_with"]["views.base"].split(", ")) == {"views.rows", "views.every_other", "views.transposed"}


def test_reading_one_tensor_reads_only_its_bytes(tmp_path):
    path = tmp_path / "big.pt"
    torch.save({"a": torch.randn(256, 256), "b": torch.randn(8)}, path)
    catalog = open_catalog(path)
    IO.reset()
    catalog.read_bytes("b")
    assert IO.snapshot()["bytes_read"] == 32


def test_unrepresentable_dtype_is_skipped_with_a_warning(tmp_path):
    path = tmp_path / "c.pt"
    torch.save({"ok": torch.ones(2), "c128": torch.zeros(2, dtype=torch.complex128)}, path)
    catalog = open_catalog(path)
    assert list(catalog.tensors) == ["ok"]
    assert any("complex128" in w for w in catalog.warnings)


class _RunsCommand:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _WritesFile:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_malicious_pickle_is_listed_never_executed(tmp_path):
    marker_a, marker_b = tmp_path / "pwned_system", tmp_path / "pwned_open"
    path = tmp_path / "evil.pt"
    torch.save({"weight": torch.ones(3), "hook": _RunsCommand(marker_a), "other": [_WritesFile(marker_b)]}, path)
    catalog = open_catalog(path)
    assert not marker_a.exists() and not marker_b.exists()
    assert list(catalog.tensors) == ["weight"]
    assert torch.equal(load_checked(catalog, "weight"), torch.ones(3))
    assert catalog.metadata["weights_only"] == "no"
    unsafe = set(catalog.metadata["unsafe_globals"].split(", "))
    assert unsafe == set(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    assert "posix.system" in unsafe and "io.open" in unsafe
    assert any("untrusted code" in w for w in catalog.warnings)
    assert not marker_a.exists() and not marker_b.exists()


def test_unsafe_flag_agrees_with_torch_on_samples():
    for path in [TORCH_SAMPLES / "pytorch_model.bin", TORCH_SAMPLES / "trainer_state.pt", SAMPLES / "training" / "lightning" / "ema.ckpt"]:
        catalog = open_catalog(path)
        ours = set(filter(None, catalog.metadata.get("unsafe_globals", "").split(", ")))
        assert ours == set(torch.serialization.get_unsafe_globals_in_checkpoint(path)), path
    assert open_catalog(TORCH_SAMPLES / "trainer_state.pt").metadata["unsafe_globals"] == "argparse.Namespace"


def test_allowlist_covers_torch_weights_only_globals():
    from torch import _weights_only_unpickler as wo

    if not hasattr(wo, "_get_allowed_globals"):
        pytest.skip("this torch has no _get_allowed_globals")
    assert [g for g in wo._get_allowed_globals() if not weights_only_allows(g)] == []
    assert not weights_only_allows("posix.system") and not weights_only_allows("builtins.eval")


def test_legacy_format_is_refused_clearly(tmp_path):
    path = tmp_path / "old.pt"
    torch.save({"a": torch.ones(2)}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointError, match="legacy") as err:
        open_catalog(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "not_torch_zip", "big_endian"])
def test_damaged_files_raise_checkpoint_error_naming_the_file(tmp_path, damage):
    path = tmp_path / "model.pt"
    torch.save({"a": torch.randn(64)}, path)
    raw = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(raw[: len(raw) - 150])
    elif damage == "garbage":
        path.write_bytes(b"this is not a checkpoint at all" * 10)
    elif damage == "not_torch_zip":
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr("readme.txt", "hello")
    else:
        src = tmp_path / "src.pt"
        path.rename(src)
        with zipfile.ZipFile(src) as zin, zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zout:
            for item in zin.infolist():
                data = b"big" if item.filename.endswith("/byteorder") else zin.read(item)
                zout.writestr(item.filename, data)
    with pytest.raises(CheckpointError) as err:
        open_catalog(path)
    assert str(path) in str(err.value)


def test_detects_torch_files_by_suffix_or_content(tmp_path):
    for name in ["w.pt", "w.bin", "w.ckpt", "weights.data"]:
        torch.save({"x": torch.ones(1)}, tmp_path / name)
        assert open_catalog(tmp_path / name).format == "torch"


def test_listing_does_not_import_torch():
    code = (
        "import sys; from workbench.formats import open_catalog; "
        f"c = open_catalog({str(TORCH_SAMPLES / 'pytorch_model.bin')!r}); c.read_bytes('proj_t.weight'); "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


# ----------------------------------------------------------------------------------------- hostile pickles

REBUILD_V2 = b"ctorch._utils\n_rebuild_tensor_v2\n"


def _four_argument_rebuild() -> bytes:
    """{'w': _rebuild_tensor_v2(<float32 storage '0' of 4>, 0, (4,), (1,))}: requires_grad left to its default."""
    storage = b"((X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x04tQ"
    return b"\x80\x02}X\x01\x00\x00\x00w" + REBUILD_V2 + storage + b"K\x00K\x04\x85K\x01\x85tRs."


@pytest.mark.parametrize(
    ("target", "state"),
    [
        (REBUILD_V2, b"N}X\x0c\x00\x00\x00__defaults__\x88\x85s\x86"),  # slot state: setattr(f, '__defaults__', (True,))
        (REBUILD_V2, b"}X\x0c\x00\x00\x00__defaults__\x88\x85s"),  # dict state: f.__dict__['__defaults__']
        (REBUILD_V2, b"N}X\x0c\x00\x00\x00__qualname__X\x04\x00\x00\x00evils\x86"),
        (b"ctorch\nSize\n", b"N}X\x0e\x00\x00\x00__kwdefaults__}s\x86"),
    ],
    ids=["slot __defaults__", "dict __defaults__", "slot __qualname__", "torch.Size __kwdefaults__"],
)
def test_state_a_pickle_sets_on_a_builder_never_reaches_the_next_file(tmp_path, target: bytes, state: bytes):
    from hostile.corpus import torch_zip

    from workbench.formats.torch_zip import inspect_file

    name = target.split(b"\n")[1].decode()
    attack = torch_zip(tmp_path / "attack.pt", b"\x80\x02" + target + state + b"b.")
    with pytest.raises(CheckpointError, match=f"tries to set attributes on [a-z._]*{name}"):
        open_catalog(attack)
    clean = torch_zip(tmp_path / "clean.pt", _four_argument_rebuild(), {"0": torch.arange(4.0).numpy().tobytes()})
    (path, ref), = inspect_file(clean).contents.tensors
    assert path == "w" and ref.shape == (4,) and ref.requires_grad is False
    assert load_checked(open_catalog(clean), "w").tolist() == [0.0, 1.0, 2.0, 3.0]


def test_trailing_memo_bomb_is_refused_with_bounded_memory(tmp_path):
    """The reported bomb, scaled down: a deflated data.pkl asks for a memo slot near its inflated size."""
    import struct
    import tracemalloc

    import numpy as np
    from hostile.corpus import torch_zip

    inflated = 8_000_000
    padding = (np.random.default_rng(3).random(inflated) < 0.008).astype(np.uint8).tobytes()
    path = torch_zip(tmp_path / "bomb.pt", b"\x80\x02]r" + struct.pack("<I", inflated - 100) + b"." + padding, deflate=True)
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match="memo index 7999900 at byte 3 is beyond the 0 memo entries"):
            open_catalog(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * inflated, f"{peak} bytes allocated to refuse a {path.stat().st_size}-byte file"


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"\x80\x02}." + b"\0" * 100, "100 bytes follow the STOP opcode at byte 3"),
        (b"\x80\x02]q\x00]r\x01\x00\x00\x00]p2\n.", None),  # sequential memo slots: sound
        (b"\x80\x02]r\x00\x10\x00\x00.", "memo index 4096 at byte 3"),
        (b"(p500\nl.", "memo index 500 at byte 1"),
        (b"(L" + b"1" * 5000 + b"L\nl.", "an integer of 5001 digits"),
        (b"(I" + b"1" * 5000 + b"\nl.", "an integer of 5000 digits"),
        (b"\x80\x02\x8b\x00\x08\x00\x00" + b"\1" * 2048 + b".", "an integer of 2048 bytes"),
    ],
    ids=["padded after STOP", "sequential memo", "LONG_BINPUT ahead", "PUT ahead", "LONG digits", "INT digits", "LONG4 bytes"],
)
def test_pickle_bounds_follow_the_real_pickle(tmp_path, body: bytes, says: str | None):
    from hostile.corpus import torch_zip

    path = torch_zip(tmp_path / "p.pt", body)
    if says is None:
        open_catalog(path)
        return
    with pytest.raises(CheckpointError) as caught:
        open_catalog(path)
    assert says in str(caught.value) and str(caught.value).startswith(f"Cannot read {path}: its pickle is corrupt or crafted")

