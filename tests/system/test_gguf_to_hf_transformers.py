"""GGUF -> HF safetensors (`M.presets.gguf_to_hf`) against transformers' own GGUF loader
(`from_pretrained(folder, gguf_file=name)`), for the families both transformers 5 and llama.cpp's converter handle here:
Llama (F16, Q8_0), Mistral, Qwen2, Phi-3 and Gemma 2 (Q8_0), Gemma 3 (F16), GPT-2 (F16, Q8_0: Conv1D weights
transposed back) from llama.cpp's converter (Gemma's norms, stored plus one, come back minus one in float32), and a
Llama GGUF holding
Q4_0/Q4_1/Q5_0/Q8_0/Q2_K..Q6_K/F16/BF16/F32 tensors of random valid blocks. transformers de-quantises every tensor to
float32 and keeps it float32 (its default dtype for GGUF files), so the folder is converted with dtype='F32' and
compared in float32, bit for bit. The folder then loads in transformers (config.json, tokenizer files from the
metadata) with the same weights and the same tokenisation.

transformers 5.24 cannot load the Qwen3, Qwen2-MoE, Qwen3-MoE or Mixtral files llama.cpp writes (it maps no head_dim
for qwen3, no expert sizes for the Qwen MoEs, and reads Mixtral's `llama` architecture as a dense Llama): those are
compared with gguf-py's own de-quantisation in tests/mapper/test_gguf_inverse.py."""

from __future__ import annotations

from pathlib import Path

import pytest

import workbench as wb
from workbench import mapper as M

pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

CASES = [("llama", "f16"), ("llama", "q8_0"), ("mistral", "q8_0"), ("qwen2", "q8_0"), ("kquant", ""),  # BF16: in kquant
         ("phi3", "q8_0"), ("gemma2", "q8_0"), ("gemma3", "f16"), ("gpt2", "f16"), ("gpt2", "q8_0")]
FAMILIES = ("phi3", "gemma2", "gemma3")  # gguf_support/families.py: families the workbench reads back but does not write


@pytest.fixture(scope="module")
def kquant(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gguf_support.kquants import build
    from gguf_support.reference import reference_gguf

    return build(reference_gguf("llama", "f16"), tmp_path_factory.mktemp("kq") / "kquant.gguf")


@pytest.fixture(scope="module", autouse=True)
def one_gguf_parse_per_file() -> object:
    """gguf-py's GGUFReader made once per file for the module, and transformers' metadata of a file (its
    `load_gguf_checkpoint` without tensors) read once: transformers opens a GGUF file anew for its config, its weights
    and each tokenizer's config (the workbench's tokenizer files among them: built in this process, which holds
    transformers and torch), and each open parses every vocabulary entry in Python (~5-10 s for Qwen2's 150k tokens).
    The files are never written while the module runs; each caller gets its own copy of the metadata."""
    import copy

    import gguf
    from transformers import modeling_gguf_pytorch_utils as utils

    readers: dict[str, object] = {}
    metadata: dict[str, dict] = {}
    new_reader, new_checkpoint = gguf.GGUFReader, utils.load_gguf_checkpoint

    def reader(path: object, mode: str = "r") -> object:
        key = str(Path(path).resolve())
        if mode != "r" or key not in readers:
            readers[key] = new_reader(path, mode)
        return readers[key]

    def checkpoint(path: object, return_tensors: bool = False, **kwargs: object) -> dict:
        if return_tensors or kwargs:
            return new_checkpoint(path, return_tensors=return_tensors, **kwargs)
        key = str(Path(path).resolve())
        if key not in metadata:
            metadata[key] = new_checkpoint(path)
        return copy.deepcopy(metadata[key])

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", reader)
        patch.setattr(utils, "load_gguf_checkpoint", checkpoint)
        yield readers


def _quiet_load(folder: Path, **kwargs: object) -> object:
    import transformers.utils.logging as logging

    logging.disable_progress_bar()
    return transformers.AutoModelForCausalLM.from_pretrained(folder, **kwargs)


@pytest.mark.parametrize(("family", "outtype"), CASES)
def test_converted_folder_equals_what_transformers_loads_from_the_gguf(family: str, outtype: str, kquant: Path,
                                                                        tmp_path: Path) -> None:
    from gguf_support import families, gpt2
    from gguf_support.reference import reference_gguf

    if family == "gpt2":  # gguf_support/gpt2.py
        path = gpt2.reference_gguf(outtype)
    else:
        path = kquant if family == "kquant" else (families.reference_gguf if family in FAMILIES else reference_gguf)(family, outtype)
    out = tmp_path / "hf"
    wb.convert(path, out, M.presets.gguf_to_hf(path, dtype="F32"), quiet=True)
    from_gguf = _quiet_load(path.parent, gguf_file=path.name).state_dict()
    from safetensors.torch import load_file

    ours = load_file(out / "model.safetensors")
    tied = sorted(set(from_gguf) - set(ours))  # Gemma: no output.weight, lm_head tied to the embeddings
    assert tied == ([] if "output.weight" in wb.open_checkpoint(path).tensors.index else ["lm_head.weight"])
    from_gguf = {name: tensor for name, tensor in from_gguf.items() if name not in tied}
    assert sorted(ours) == sorted(from_gguf)
    for name, tensor in from_gguf.items():
        assert tensor.dtype == ours[name].dtype == torch.float32, name
        assert torch.equal(tensor.view(torch.int32), ours[name].view(torch.int32)), name
    loaded = _quiet_load(out).state_dict()  # config.json and the weights as the folder holds them
    for name, tensor in from_gguf.items():
        assert torch.equal(tensor.view(torch.int32), loaded[name].view(torch.int32)), name
    text = "Hello world, the 1234 tokens!"
    theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert transformers.AutoTokenizer.from_pretrained(out)(text).input_ids == theirs(text).input_ids
