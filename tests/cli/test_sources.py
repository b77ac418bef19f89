"""Issue 29 D8, D9: the sources the command line names are the ones converted. Two --adapter folders
merge one after the other, bit for bit as PEFT's merge_and_unload applied twice; a repeated --source
name and `--source base=X` (which replaced SRC) are refused with a clear message."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from workbench.cli import commands as cli


def run(*args: str | Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    status = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return status, out, err


@pytest.fixture(scope="module")
def two_adapters(tmp_path_factory: pytest.TempPathFactory):
    """A tiny Llama, two different adapters (one rsLoRA) saved by peft, and PEFT merging A then B."""
    pytest.importorskip("peft")
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from peft_fixtures import base_model, randomise

    root = tmp_path_factory.mktemp("two-adapters")
    base_model("llama").save_pretrained(root / "base")
    first = get_peft_model(base_model("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    randomise(first, 1)
    first.save_pretrained(root / "a")
    second = get_peft_model(base_model("llama"), LoraConfig(r=2, lora_alpha=2, target_modules=["q_proj", "o_proj"], use_rslora=True))
    randomise(second, 2)
    second.save_pretrained(root / "b")
    model = PeftModel.from_pretrained(base_model("llama"), root / "a").merge_and_unload()
    model = PeftModel.from_pretrained(model, root / "b").merge_and_unload()
    with torch.no_grad():
        reference = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    return root, reference


def test_two_adapters_merge_in_order_as_peft_does(two_adapters, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors.numpy import load_file

    root, reference = two_adapters
    status, out, err = run("convert", root / "base", tmp_path / "out", "--adapter", root / "a", "--adapter", root / "b",
                           "--quiet", capsys=capsys)
    assert status == 0, err
    merged = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(merged) == set(reference)
    for name, value in merged.items():
        assert np.array_equal(value, reference[name]), name  # bit for bit, both adapters' deltas
    only_b = load_file(str(root / "base" / "model.safetensors"))
    q = "model.layers.0.self_attn.q_proj.weight"
    v = "model.layers.0.self_attn.v_proj.weight"
    assert not np.array_equal(merged[v], only_b[v])  # A's merge is there (B does not touch v_proj)
    assert not np.array_equal(merged[q], only_b[q])


def sample(folder: Path, value: float) -> Path:
    folder.mkdir()
    save_file({"w": np.full(3, value, np.float32)}, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("command", ["plan", "convert", "diff"])
def test_source_base_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str) -> None:
    src, other = sample(tmp_path / "src", 1.0), sample(tmp_path / "other", 2.0)
    args = {"plan": ["plan", src], "convert": ["convert", src, tmp_path / "out"], "diff": ["diff", src, other]}[command]
    status, out, err = run(*args, "--source", f"base={other}", capsys=capsys)
    assert status == 2 and out == ""
    assert "Cannot use --source 'base=" in err and "'base' is SRC" in err and "--source other=" in err
    assert not (tmp_path / "out").exists()


def test_a_repeated_source_name_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src, one, two = sample(tmp_path / "src", 1.0), sample(tmp_path / "one", 2.0), sample(tmp_path / "two", 3.0)
    status, _, err = run("plan", src, "--source", f"x={one}", "--source", f"x={two}", capsys=capsys)
    assert status == 2 and "Cannot use --source x= twice" in err and str(one) in err and str(two) in err
    status, _, err = run("plan", src, "--source", f"adapter={one}", "--adapter", two, capsys=capsys)
    assert status == 2 and "with --adapter" in err


# ----------------------------------------------------------------------------- D10 URL destinations

URL_DESTINATIONS = ["https://example.com/out/", "gs://b/p"]  # (s3:// and hf:// are destinations: output/remote/)


@pytest.mark.parametrize("url", URL_DESTINATIONS)
def test_a_url_destination_is_refused_everywhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str], url: str) -> None:
    import workbench as wb
    from workbench.errors import PlanError

    src = sample(tmp_path / "src", 1.0)
    monkeypatch.chdir(tmp_path)
    refusal = f"Cannot write to {url}: the workbench writes to local folders and to s3://, hf:// destinations"
    with pytest.raises(PlanError, match=refusal):
        wb.plan(src, None, dest=url)
    with pytest.raises(PlanError, match="Convert into a local folder, then upload it"):
        wb.convert(src, url, quiet=True)
    status, out, err = run("convert", src, url, "--quiet", capsys=capsys)
    assert status == 2 and refusal in err
    status, out, err = run("plan", src, "--dest", url, capsys=capsys)
    assert status == 2 and refusal in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no folder named 's3:' (or 'hf:' ...) appeared


# --------------------------------------------------------------- D17 a mapper reading an absent source


def test_diff_through_a_merge_without_the_adapter_says_to_add_it(two_adapters, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """The README's example opened only the base; the error now says how to open the adapter with it, and the
    corrected example (both sources) compares the merge with a real merge: nothing differs."""
    import workbench as wb
    from workbench import mapper as M
    from workbench.errors import MapperError

    root, _ = two_adapters
    merged = tmp_path / "merged"
    assert run("convert", root / "base", merged, "--adapter", root / "a", "--quiet", capsys=capsys)[0] == 0
    with pytest.raises(MapperError, match=r"checkpoint named 'adapter'.*wb\.open_checkpoint\(\{'base': BASE, 'adapter': PATH\}\)"
                                          r".*--source adapter=PATH"):
        wb.open_checkpoint(root / "base").diff(merged, mapper=M.presets.lora_merge(root / "a"), values=True)
    mapper_file = tmp_path / "merge.py"
    mapper_file.write_text(M.presets.lora_merge(root / "a").to_code())
    status, _, err = run("diff", root / "base", merged, "--mapper", mapper_file, capsys=capsys)
    assert status == 2 and "add --source adapter=PATH" in err and "closest name" not in err
    fixed = wb.open_checkpoint({"base": root / "base", "adapter": root / "a"})
    assert len(fixed.diff(merged, mapper=M.presets.lora_merge(root / "a"), values=True)) == 0
    status, out, err = run("diff", root / "base", merged, "--mapper", mapper_file, "--source", f"adapter={root / 'a'}",
                           "--values", capsys=capsys)
    assert status == 0, err
