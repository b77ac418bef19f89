"""Build mergekit's reference merges of tiny Llama models and record them (digests, not weights) for the tests.

The inputs are tiny transformers-layout Llama checkpoints (config.json, model.safetensors with `{"format": "pt"}`
metadata, a word-level tokenizer.json) whose weights come from fixed torch seeds: a base and three fine-tunes
(base + small deltas), stored once in fp32 (`fp32/`) and once in bf16 (`bf16/`), and a tokenizer set (`tok/`) whose
third fine-tune has two extra tokens. `build_inputs(folder)` writes them; the tests call it too (a second or so),
so only the digests of the inputs are committed, and a test first compares its regenerated inputs with them
("inputs changed", not a puzzling merge mismatch).

For every config in CASES, `mergekit-yaml CONFIG OUT --lazy-unpickle --no-copy-tokenizer --clone-tensors
--random-seed SEED` runs from mergekit's own venv (`.cache/fixtures/venv-mergekit-<ver>-torch-<ver>/`; mergekit
needs transformers >= 5, the project venv must not hold it), and the output's tensors are digested one by one,
with the logits of the merged model (loaded by transformers in fp32) on a fixed input. tests/fixtures/mergekit/
then holds each case's config (`configs/<case>.yml`, model paths relative to the inputs folder: `fp32/base`, ...)
and MANIFEST.json (its `format` key describes the layout). Usage:

    python scripts/make_mergekit_fixtures.py            # build in .cache/fixtures/mergekit-.../ (no-op when done)
    python scripts/make_mergekit_fixtures.py --commit   # build, then replace tests/fixtures/mergekit/
    python scripts/make_mergekit_fixtures.py --print-root | --print-built-root
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

MERGEKIT = "0.1.5"
TORCH = "2.13.0"
REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache" / "fixtures"
COMMITTED = REPO / "tests" / "fixtures" / "mergekit"
FIXTURE_VERSION = 1  # bump when the inputs or the cases change
SEED = 42

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 32, 64, 4, 4, 2
WORDS = [f"w{i}" for i in range(60)]
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
EXTRA = ["zeta", "omega"]  # the tok set's third fine-tune adds these two tokens
LOGITS_INPUT = [1, 7, 21, 42, 5, 63]  # token ids the logits are taken on (every model's vocabulary holds them)

FORMAT = (
    "inputs: model name (e.g. 'fp32/base') -> {tensor name -> sha256 of dtype|shape|bytes} of the inputs that "
    "build_inputs() in scripts/make_mergekit_fixtures.py regenerates; cases: case name -> {config: path of the "
    "mergekit YAML under configs/ (model paths relative to the inputs folder), seed: mergekit's --random-seed, "
    "random: true when the method draws random numbers (then statistics: {changed_fraction, mean_abs_delta} of the output against the base model, over all tensors}, tensors: {output tensor name -> {dtype (safetensors code), "
    "shape, sha256 of the raw little-endian bytes}}, output_config: the output config.json's num_hidden_layers / "
    "vocab_size / dtype, logits: {input_ids, values (fp32 logits of the merged model loaded by transformers in fp32, "
    "one string per input position: the vocabulary's values as %.8g separated by spaces)}}; tools: versions; failed: case -> mergekit's error (not built)."
)


def _config(vocab: int, dtype: str) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HIDDEN // HEADS,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu",
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3,
        "attention_bias": False, "mlp_bias": False, "initializer_range": 0.02, "dtype": dtype,
        "transformers_version": "5.0.0",
    }


def _shapes(vocab: int) -> dict[str, tuple[int, ...]]:
    kv = KV_HEADS * (HIDDEN // HEADS)
    shapes = {"model.embed_tokens.weight": (vocab, HIDDEN), "model.norm.weight": (HIDDEN,), "lm_head.weight": (vocab, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,),
            p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN), p + "self_attn.k_proj.weight": (kv, HIDDEN),
            p + "self_attn.v_proj.weight": (kv, HIDDEN), p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
            p + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN), p + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
        })
    return shapes


def _weights(seed: int, vocab: int, base: dict | None = None) -> dict:
    """fp32 weights: random normal * 0.1 (norms around 1) for the base; base + 0.02 * noise for a fine-tune
    (rows beyond the base's vocabulary drawn fresh)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in sorted(_shapes(vocab).items()):
        noise = torch.randn(shape, generator=gen, dtype=torch.float32)
        if base is None:
            out[name] = 1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.1 * noise
            continue
        start = base[name].clone()
        if start.shape != noise.shape:  # extra vocabulary rows
            start = torch.cat([start, 0.1 * noise[start.shape[0]:]])
        out[name] = start + 0.02 * noise
    return out


def _tokenizer(vocab_words: list[str]) -> tuple[dict, dict]:
    vocab = {w: i for i, w in enumerate(SPECIALS + vocab_words)}
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for i, t in enumerate(SPECIALS)]
    tokenizer = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
                 "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None, "decoder": None,
                 "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<s>",
              "eos_token": "</s>", "pad_token": "<pad>", "model_max_length": 64, "clean_up_tokenization_spaces": False}
    return tokenizer, config


def _write_model(folder: Path, weights: dict, dtype: str, words: list[str]) -> None:
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    vocab = len(SPECIALS) + len(words)
    (folder / "config.json").write_text(json.dumps(_config(vocab, dtype), indent=2, sort_keys=True) + "\n")
    tokenizer, tok_config = _tokenizer(words)
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer, indent=1) + "\n")
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=1, sort_keys=True) + "\n")
    save_file({k: v.to(torch_dtype).contiguous() for k, v in sorted(weights.items())},
              str(folder / "model.safetensors"), metadata={"format": "pt"})


INPUT_MODELS = [f"{s}/{m}" for s in ("fp32", "bf16") for m in ("base", "ft1", "ft2", "ft3")] + \
    ["tok/base", "tok/ft1", "tok/ft3", "llama/base", "llama/ft1", "llama/ft2"]
SAMPLE = REPO / "sample_checkpoints" / "tiny-llama"  # notebook 07 merges two fine-tunes of it


def sample_fine_tune(seed: int) -> dict:
    """A "fine-tune" of the bundled tiny Llama, as notebook 07 makes it: every tensor + 0.02 * normal noise drawn
    from one torch generator seeded `seed`, tensors in name order (fp32, like the sample)."""
    import torch
    from safetensors.torch import load_file

    base = {k: v for f in sorted(SAMPLE.glob("*.safetensors")) for k, v in load_file(f).items()}
    gen = torch.Generator().manual_seed(seed)
    return {name: base[name] + 0.02 * torch.randn(base[name].shape, generator=gen, dtype=base[name].dtype)
            for name in sorted(base)}


def build_inputs(folder: Path) -> Path:
    """Write every input model under `folder` (`fp32/base`, `bf16/ft2`, `tok/ft3`, ...); deterministic."""
    vocab = len(SPECIALS) + len(WORDS)
    base = _weights(1000, vocab)
    fine = {f"ft{i}": _weights(1000 + i, vocab, base) for i in (1, 2, 3)}
    for store, dtype in (("fp32", "float32"), ("bf16", "bfloat16")):
        _write_model(folder / store / "base", base, dtype, WORDS)
        for name, weights in fine.items():
            _write_model(folder / store / name, weights, dtype, WORDS)
    # The tokenizer set: base and ft1 share the vocabulary; ft3's has two more tokens and a shuffled tail.
    _write_model(folder / "tok" / "base", base, "float32", WORDS)
    _write_model(folder / "tok" / "ft1", fine["ft1"], "float32", WORDS)
    wide = _weights(1003, vocab + len(EXTRA), base)
    words = WORDS[:50] + list(reversed(WORDS[50:])) + EXTRA  # same strings, other ids for the last ten
    _write_model(folder / "tok" / "ft3", wide, "float32", words)
    from safetensors.torch import save_file

    shutil.copytree(SAMPLE, folder / "llama" / "base", dirs_exist_ok=True)
    for i in (1, 2):
        (folder / "llama" / f"ft{i}").mkdir(parents=True, exist_ok=True)
        shutil.copy(SAMPLE / "config.json", folder / "llama" / f"ft{i}" / "config.json")
        save_file(sample_fine_tune(i), str(folder / "llama" / f"ft{i}" / "model.safetensors"), metadata={"format": "pt"})
    build_tokenizer_inputs(folder)
    return folder


def tensor_digests(path: Path) -> dict[str, dict]:
    """tensor name -> {dtype, shape, sha256 of its bytes} of one safetensors file (or every shard of a folder)."""
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    out = {}
    for file in files:
        data = file.read_bytes()
        size = int.from_bytes(data[:8], "little")
        header = json.loads(data[8: 8 + size])
        header.pop("__metadata__", None)
        body = memoryview(data)[8 + size:]
        for name, entry in header.items():
            begin, end = entry["data_offsets"]
            out[name] = {"dtype": entry["dtype"], "shape": entry["shape"],
                         "sha256": hashlib.sha256(body[begin:end]).hexdigest()}
    return dict(sorted(out.items()))


def logits_values(entry: dict) -> list[list[float]]:
    """A case's recorded logits as numbers ([position][vocabulary])."""
    return [[float(v) for v in row.split()] for row in entry["logits"]["values"]]


def input_digests(folder: Path) -> dict[str, dict[str, str]]:
    """model name -> {tensor name -> sha256 of dtype|shape|bytes} (the committed check that inputs did not change)."""
    out = {}
    for model in INPUT_MODELS + TOKENIZER_MODELS:
        tensors = tensor_digests(folder / model)
        digest = hashlib.sha256()
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            if (folder / model / name).is_file():
                digest.update((folder / model / name).read_bytes())
        out[model] = {"files": digest.hexdigest(),
                      **{n: hashlib.sha256(f"{e['dtype']}|{e['shape']}|{e['sha256']}".encode()).hexdigest()
                         for n, e in tensors.items()}}
    return out


def _models(store: str, names: list[str], params: list[dict | None]) -> list[dict]:
    return [{"model": f"{store}/{n}", **({"parameters": p} if p else {})} for n, p in zip(names, params, strict=True)]


def cases() -> dict[str, dict]:
    """case name -> mergekit config (model paths relative to the inputs folder)."""
    out: dict[str, dict] = {}
    for store in ("fp32", "bf16"):
        b = f"{store}/base"
        w2 = [{"weight": 0.6}, {"weight": 0.4}]
        tv = [{"weight": 0.7, "density": 0.5}, {"weight": 0.5, "density": 0.6}]
        methods = {
            "linear": {"models": _models(store, ["ft1", "ft2", "ft3"], [{"weight": 0.5}, {"weight": 0.3}, {"weight": 0.2}])},
            "slerp": {"models": _models(store, ["base", "ft1"], [None, None]), "base_model": b,
                      "parameters": {"t": 0.3}},
            "nuslerp": {"models": _models(store, ["ft1", "ft2"], w2), "parameters": {}},
            "multislerp": {"models": _models(store, ["ft1", "ft2", "ft3"], [{"weight": 1.0}, {"weight": 0.5}, {"weight": 0.25}])},
            "karcher": {"models": _models(store, ["ft1", "ft2", "ft3"], [None, None, None])},
            "task_arithmetic": {"models": _models(store, ["ft1", "ft2"], w2), "base_model": b},
            "ties": {"models": _models(store, ["ft1", "ft2", "ft3"], [*tv, {"weight": 0.4, "density": 0.7}]), "base_model": b},
            "dare_linear": {"models": _models(store, ["ft1", "ft2"], tv), "base_model": b},
            "dare_ties": {"models": _models(store, ["ft1", "ft2"], tv), "base_model": b},
            "breadcrumbs": {"models": _models(store, ["ft1", "ft2"], [{"weight": 0.7, "density": 0.8, "gamma": 0.05},
                                                                     {"weight": 0.5, "density": 0.9, "gamma": 0.02}]), "base_model": b},
            "breadcrumbs_ties": {"models": _models(store, ["ft1", "ft2"], [{"weight": 0.7, "density": 0.8, "gamma": 0.05},
                                                                          {"weight": 0.5, "density": 0.9, "gamma": 0.02}]), "base_model": b},
            "della": {"models": _models(store, ["ft1", "ft2"], [{"weight": 0.7, "density": 0.5, "epsilon": 0.1},
                                                               {"weight": 0.5, "density": 0.6, "epsilon": 0.15}]), "base_model": b},
            "della_linear": {"models": _models(store, ["ft1", "ft2"], [{"weight": 0.7, "density": 0.5, "epsilon": 0.1},
                                                                      {"weight": 0.5, "density": 0.6, "epsilon": 0.15}]), "base_model": b},
            "sce": {"models": _models(store, ["ft1", "ft2", "ft3"], [None, None, None]), "base_model": b,
                    "parameters": {"select_topk": 0.5}},
            "model_stock": {"models": _models(store, ["ft1", "ft2", "ft3"], [None, None, None]), "base_model": b},
            "nearswap": {"models": _models(store, ["base", "ft1"], [None, None]), "base_model": b, "parameters": {"t": 0.02}},
            "passthrough": {"models": _models(store, ["ft2"], [{"scale": 0.5}])},
        }
        for method, body in methods.items():
            config = {"merge_method": method, **body}
            if store == "bf16" and method in ("linear", "ties", "slerp"):  # fp32 arithmetic, bf16 output
                out[f"{method}-{store}-dtype"] = {**config, "dtype": "float32", "out_dtype": "bfloat16"}
            out[f"{method}-{store}"] = config
        # gradients (t across layers, evaluated at t=0 for embeddings, the final norm and lm_head) and filters
        out[f"slerp-gradient-{store}"] = {"merge_method": "slerp", "base_model": b,
                                          "models": _models(store, ["base", "ft1"], [None, None]),
                                          "parameters": {"t": [{"filter": "self_attn", "value": [0, 0.5, 0.3, 0.7, 1]},
                                                               {"filter": "mlp", "value": [1, 0.5, 0.7, 0.3, 0]},
                                                               {"value": 0.5}]}}
        out[f"ties-gradient-{store}"] = {"merge_method": "ties", "base_model": b,
                                         "models": _models(store, ["ft1", "ft2"], [
                                             {"weight": [0.2, 0.8], "density": [{"filter": "mlp", "value": 0.3}, {"value": 0.7}]},
                                             {"weight": 0.5, "density": 0.5}]),
                                         "parameters": {"normalize": False}}
        # slices: a frankenmerge (passthrough), and a layer-by-layer slerp with a gradient over each slice
        out[f"passthrough-slices-{store}"] = {"merge_method": "passthrough", "slices": [
            {"sources": [{"model": f"{store}/ft1", "layer_range": [0, 3]}]},
            {"sources": [{"model": f"{store}/ft2", "layer_range": [1, 4]}]},
            {"sources": [{"model": f"{store}/ft1", "layer_range": [3, 4]}]}]}
        out[f"slerp-slices-{store}"] = {"merge_method": "slerp", "base_model": b, "slices": [
            {"sources": [{"model": b, "layer_range": [0, 2]}, {"model": f"{store}/ft1", "layer_range": [0, 2]}]},
            {"sources": [{"model": b, "layer_range": [1, 4]}, {"model": f"{store}/ft2", "layer_range": [1, 4]}]}],
            "parameters": {"t": [0, 1]}}
        # overlapping slices merged by TIES: per-source parameters (a filter, a gradient), a slice's own parameters
        # and base model, layers read twice
        out[f"ties-slices-{store}"] = {"merge_method": "ties", "base_model": b, "slices": [
            {"sources": [{"model": b, "layer_range": [0, 3]},
                         {"model": f"{store}/ft1", "layer_range": [0, 3],
                          "parameters": {"weight": [{"filter": "mlp", "value": [0.2, 0.9]}, {"value": 0.6}], "density": 0.5}},
                         {"model": f"{store}/ft2", "layer_range": [1, 4], "parameters": {"weight": 0.4, "density": 0.7}}],
             "parameters": {"normalize": False}},
            {"sources": [{"model": f"{store}/ft3", "layer_range": [2, 4], "parameters": {"weight": 1.0}},
                         {"model": f"{store}/ft1", "layer_range": [2, 4], "parameters": {"weight": 0.5}},
                         {"model": b, "layer_range": [2, 4], "parameters": {"weight": 0.3}}],
             "base_model": f"{store}/ft3", "parameters": {"density": 0.6}}]}
        # the random methods in mergekit's one stream (--random-seed): per-tensor densities (a filter, a gradient, 1 where
        # nothing is drawn), three models, slices whose layers run in another order than the output's, a cast
        out[f"dare_ties-gradient-{store}"] = {"merge_method": "dare_ties", "base_model": b, "models": _models(store, ["ft1", "ft2", "ft3"], [
            {"weight": [0.2, 0.8], "density": [{"filter": "mlp", "value": [0.3, 0.9]}, {"filter": "self_attn", "value": 1.0},
                                               {"value": 0.7}]},
            {"weight": 0.5, "density": 0.5}, {"weight": 0.3, "density": 1.0}])}
        out[f"della_linear-slices-{store}"] = {"merge_method": "della_linear", "base_model": b, "slices": [
            {"sources": [{"model": b, "layer_range": [2, 4]},
                         {"model": f"{store}/ft1", "layer_range": [2, 4], "parameters": {"weight": 0.7, "density": 0.4}}]},
            {"sources": [{"model": b, "layer_range": [0, 2]},
                         {"model": f"{store}/ft2", "layer_range": [0, 2], "parameters": {"weight": 0.5, "density": [0.3, 0.6]}}]}],
            "parameters": {"epsilon": 0.1}}
        if store == "bf16":
            out["dare_linear-bf16-dtype"] = {**out["dare_linear-bf16"], "dtype": "float32", "out_dtype": "bfloat16"}
    # tokenizer_source: the vocabulary of the base, and the union of all (ft3 has two more tokens, ten moved)
    tok = _models("tok", ["base", "ft1", "ft3"], [{"weight": 0.2}, {"weight": 0.5}, {"weight": 0.3}])
    out["linear-tokenizer-base"] = {"merge_method": "linear", "models": tok, "base_model": "tok/base",
                                    "tokenizer_source": "base", "dtype": "float32"}
    out["linear-tokenizer-union"] = {"merge_method": "linear", "models": tok, "base_model": "tok/base",
                                     "tokenizer_source": "union", "dtype": "float32"}
    out["task_arithmetic-tokenizer-union"] = {"merge_method": "task_arithmetic", "models": tok, "base_model": "tok/base",
                                              "tokenizer_source": "union", "dtype": "float32"}
    # notebook 07: two fine-tunes of the bundled tiny Llama, by SLERP with a gradient and by TIES
    llama = _models("llama", ["ft1", "ft2"], [None, None])
    out["notebook-slerp"] = {"merge_method": "slerp", "base_model": "llama/ft1", "models": llama,
                             "parameters": {"t": [0, 0.5, 1]}}
    out["notebook-ties"] = {"merge_method": "ties", "base_model": "llama/base", "dtype": "float32",
                            "models": _models("llama", ["ft1", "ft2"], [{"weight": 0.6, "density": 0.5},
                                                                        {"weight": 0.4, "density": 0.5}])}
    out.update(tokenizer_cases())
    return out


RANDOM = {"dare_linear", "dare_ties", "della", "della_linear"}

LOGITS = r'''
import json, sys, torch
from transformers import AutoModelForCausalLM
torch.set_num_threads(1)
ids = torch.tensor([json.loads(sys.argv[1])])
out = {}
for folder in sys.argv[2:]:
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0]
        out[folder] = [" ".join("%.8g" % v for v in row) for row in logits.tolist()]
    except Exception as exc:  # recorded, the case's logits check then skips
        out[folder] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
'''


# Tokenizer settings (tokenizer_source union / a model, chat_template): their own inputs, cases and records, kept
# apart from the method cases above.
TOKENIZER_MODELS = ["tok/ft5", "wide/base", "wide/ft1", "wide/ft2", "bpe/base", "bpe/ft1"]
TOKENIZER_KEYS = ("tokenizer_source", "tokenizer", "chat_template")
CHAT_SPECIALS = ["<|im_start|>", "<|im_end|>"]
FT5_WORDS = WORDS[:40] + list(reversed(WORDS[45:])) + ["alpha", "zeta", "beta"]  # w40-w44 missing, zeta shared with ft3
FT5_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}\n")
LITERAL_TEMPLATE = "{% for message in messages %}[{{ message['role'] }}] {{ message['content'] }}\n{% endfor %}"


def build_tokenizer_inputs(folder: Path) -> None:
    """tok/ft5: a vocabulary that lacks five of the base's words, moves fifteen, adds three words (zeta also in ft3)
    and two added special tokens; its tokenizer_config.json carries a chat template."""
    vocab = len(SPECIALS) + len(FT5_WORDS) + len(CHAT_SPECIALS)
    base = _weights(1000, len(SPECIALS) + len(WORDS))
    where = folder / "tok" / "ft5"
    _write_model(where, _weights(1005, vocab, base), "float32", FT5_WORDS + CHAT_SPECIALS)
    tokenizer = json.loads((where / "tokenizer.json").read_text())
    first = len(SPECIALS) + len(FT5_WORDS)
    tokenizer["added_tokens"] += [{"id": first + i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                                   "normalized": False, "special": True} for i, t in enumerate(CHAT_SPECIALS)]
    (where / "tokenizer.json").write_text(json.dumps(tokenizer, indent=1) + "\n")
    tok_config = json.loads((where / "tokenizer_config.json").read_text())
    tok_config["chat_template"] = FT5_TEMPLATE
    (where / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=1, sort_keys=True) + "\n")
    build_cut_inputs(folder)


WIDE_ROWS = 72  # wide/*: config.json's vocab_size and the embedding rows, beyond the tokenizer's 64 tokens (as Qwen2's)
BPE_BELOW = WORDS[:57] + ["z", "y", "zy"]  # bpe/*: 64 tokens below vocab_size 64 ...
BPE_BEYOND = ["yy", "yyy"]  # ... and two plain tokens and one added token beyond it, which mergekit strips
BPE_EXTRA = "<|extra|>"


def build_cut_inputs(folder: Path) -> None:
    """wide/base, ft1, ft2: one shared word-level tokenizer of 64 tokens and 72 embedding rows (vocab_size 72);
    bpe/base, ft1: one shared BPE tokenizer with 64 tokens below vocab_size 64 and three beyond (two plain tokens, one
    merge that uses them, an added token), listed in tokenizer_config.json's added_tokens_decoder."""
    base = _weights(1000, WIDE_ROWS)
    for name, weights in (("base", base), ("ft1", _weights(1001, WIDE_ROWS, base)), ("ft2", _weights(1002, WIDE_ROWS, base))):
        where = folder / "wide" / name
        _write_model(where, weights, "float32", WORDS)
        config = json.loads((where / "config.json").read_text())
        config["vocab_size"] = WIDE_ROWS
        (where / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    vocab = len(SPECIALS) + len(BPE_BELOW)
    base = _weights(1100, vocab)
    for name, weights in (("base", base), ("ft1", _weights(1101, vocab, base))):
        where = folder / "bpe" / name
        _write_model(where, weights, "float32", BPE_BELOW)
        tokenizer = json.loads((where / "tokenizer.json").read_text())
        words = {**tokenizer["model"]["vocab"], **{t: vocab + i for i, t in enumerate(BPE_BEYOND)}}
        tokenizer["model"] = {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                              "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                              "vocab": words, "merges": [["z", "y"], ["yy", "y"]]}
        tokenizer["added_tokens"].append({"id": vocab + len(BPE_BEYOND), "content": BPE_EXTRA, "single_word": False,
                                          "lstrip": False, "rstrip": False, "normalized": False, "special": True})
        (where / "tokenizer.json").write_text(json.dumps(tokenizer, indent=1) + "\n")
        tok_config = json.loads((where / "tokenizer_config.json").read_text())
        tok_config["added_tokens_decoder"] = {str(t["id"]): {k: v for k, v in t.items() if k != "id"}
                                              for t in tokenizer["added_tokens"]}
        (where / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=1, sort_keys=True) + "\n")


def tokenizer_cases() -> dict[str, dict]:
    """The tokenizer cases: union over three vocabularies (a token two models add is averaged), a model as the
    tokenizer source, and chat templates (a literal one, a built-in name, 'auto')."""
    three = _models("tok", ["base", "ft3", "ft5"], [{"weight": 0.5}, {"weight": 0.3}, {"weight": 0.2}])
    pair = _models("tok", ["base", "ft5"], [{"weight": 0.6}, {"weight": 0.4}])
    return {
        "linear-tokenizer-union-added": {"merge_method": "linear", "models": three, "base_model": "tok/base",
                                         "tokenizer_source": "union", "dtype": "float32"},
        "ties-tokenizer-model": {"merge_method": "ties", "base_model": "tok/base", "tokenizer_source": "tok/ft5",
                                 "models": _models("tok", ["ft3", "ft5"], [{"weight": 0.6, "density": 0.5},
                                                                           {"weight": 0.4, "density": 0.7}]),
                                 "dtype": "float32"},
        "linear-tokenizer-section": {"merge_method": "linear", "models": pair, "base_model": "tok/base",
                                     "tokenizer": {"source": "union"}, "dtype": "float32"},
        "linear-chat-template-literal": {"merge_method": "linear", "models": pair, "base_model": "tok/base",
                                         "tokenizer_source": "base", "chat_template": LITERAL_TEMPLATE, "dtype": "float32"},
        "linear-chat-template-chatml": {"merge_method": "linear", "models": pair, "base_model": "tok/base",
                                        "tokenizer_source": "union", "chat_template": "chatml", "dtype": "float32"},
        "linear-chat-template-auto": {"merge_method": "linear", "models": pair, "base_model": "tok/base",
                                      "tokenizer_source": "base", "chat_template": "auto", "dtype": "float32"},
        # per-token embedding sources (a model, a model's token by string or id, zeros; forced or not), a new token,
        # and the vocabulary padded to a multiple (the padding rows: the mean of the others)
        "linear-tokenizer-tokens": {"merge_method": "linear", "models": three, "base_model": "tok/base", "dtype": "float32",
                                    "tokenizer": {"source": "union", "pad_to_multiple_of": 32, "tokens": {
                                        "<|im_start|>": {"source": "tok/ft5"},
                                        "<|im_end|>": {"source": {"kind": "model_token", "model": "tok/ft5", "token": "</s>"},
                                                       "force": True},
                                        "w3": {"source": {"kind": "zero"}, "force": True},
                                        "zeta": {"source": "tok/ft3"},
                                        "<new>": {"source": {"kind": "model_token", "model": "tok/base", "token_id": 5}}}}},
        "ties-tokenizer-pad": {"merge_method": "ties", "base_model": "tok/base", "dtype": "float32",
                               "models": _models("tok", ["ft1", "ft3"], [{"weight": 0.6, "density": 0.5},
                                                                         {"weight": 0.4, "density": 0.7}]),
                               "tokenizer": {"source": "base", "pad_to_multiple_of": 48}},
        # one shared vocabulary, shorter than the embedding (Qwen2-like): mergekit keeps the tokenizer's rows only
        "linear-tokenizer-base-cut": {"merge_method": "linear", "tokenizer_source": "base", "base_model": "wide/base",
                                      "models": _models("wide", ["base", "ft1"], [{"weight": 0.6}, {"weight": 0.4}])},
        "ties-tokenizer-union-cut": {"merge_method": "ties", "tokenizer_source": "union", "base_model": "wide/base",
                                     "models": _models("wide", ["ft1", "ft2"], [{"weight": 0.6, "density": 0.5},
                                                                                {"weight": 0.4, "density": 0.7}])},
        "linear-tokenizer-model-cut": {"merge_method": "linear", "tokenizer_source": "wide/ft1",
                                       "models": _models("wide", ["ft1", "ft2"], [{"weight": 0.5}, {"weight": 0.5}])},
        "slerp-tokenizer-pad-cut": {"merge_method": "slerp", "base_model": "wide/base", "parameters": {"t": 0.3},
                                    "models": _models("wide", ["base", "ft1"], [None, None]),
                                    "tokenizer": {"source": "base", "pad_to_multiple_of": 48}},
        # tokens beyond vocab_size in the base's BPE tokenizer: mergekit strips them (vocabulary, added tokens, merges)
        "linear-tokenizer-base-strip": {"merge_method": "linear", "tokenizer_source": "base", "base_model": "bpe/base",
                                        "models": _models("bpe", ["base", "ft1"], [{"weight": 0.3}, {"weight": 0.7}])},
        # ... and over another vocabulary: rows moved by token to the stripped base, or to its union with the other
        "linear-tokenizer-base-strip-align": {"merge_method": "linear", "tokenizer_source": "base", "base_model": "bpe/base",
                                              "models": [{"model": "bpe/base", "parameters": {"weight": 0.5}},
                                                         {"model": "tok/ft3", "parameters": {"weight": 0.5}}]},
        "linear-tokenizer-union-strip": {"merge_method": "linear", "tokenizer_source": "union", "base_model": "bpe/base",
                                         "models": [{"model": "bpe/base", "parameters": {"weight": 0.5}},
                                                    {"model": "tok/ft3", "parameters": {"weight": 0.5}}]},
    }


def tokenizer_record(out: Path) -> dict:
    """What a merge with tokenizer settings wrote: the vocabulary (token -> id, the model's and the added tokens),
    the added tokens' entries, the chat template (chat_template.jinja, else tokenizer_config.json's), and for each
    vocabulary-indexed tensor the SHA-256 of every token's row (mergekit orders a union's new tokens by hash-map
    iteration, different from run to run: rows are compared by token)."""
    tokenizer = json.loads((out / "tokenizer.json").read_text(encoding="utf-8"))
    raw = tokenizer["model"]["vocab"]
    vocab = {t[0]: i for i, t in enumerate(raw)} if isinstance(raw, list) else dict(raw)
    vocab.update({t["content"]: t["id"] for t in tokenizer["added_tokens"]})
    config = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
    jinja = out / "chat_template.jinja"
    template = jinja.read_text(encoding="utf-8") if jinja.is_file() else config.get("chat_template")
    by_id = {i: t for t, i in vocab.items()}
    data = (out / "model.safetensors").read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8: 8 + size])
    rows: dict[str, dict[str, str]] = {}
    for name, entry in sorted(header.items()):
        if name == "__metadata__" or not name.endswith(("embed_tokens.weight", "lm_head.weight")):
            continue
        begin, end = entry["data_offsets"]
        width = (end - begin) // entry["shape"][0]
        body = data[8 + size + begin: 8 + size + end]
        rows[name] = {by_id.get(j, f"#{j}"): hashlib.sha256(body[j * width:(j + 1) * width]).hexdigest()
                      for j in range(entry["shape"][0])}
    return {"vocab": dict(sorted(vocab.items(), key=lambda item: item[1])), "added_tokens": tokenizer["added_tokens"],
            "chat_template": template, "rows": rows}


def comparable(entry: dict) -> dict:
    """What a rebuild must reproduce of a case: its tensor digests, the vocabulary-indexed tensors' rows by token when
    the case records a tokenizer (a union's new tokens come in mergekit's hash-map order, different per run)."""
    rows = (entry.get("tokenizer") or {}).get("rows") or {}
    return {name: rows.get(name, digest) for name, digest in (entry.get("tensors") or {}).items()}


def add_cases(names: list[str]) -> int:
    """Run mergekit on the named cases only and add them (configs, entries, input digests) to the committed fixture,
    leaving every other recorded case as it is; an existing case gets its tokenizer record added."""
    import yaml

    root = fixture_root()
    bin_dir = build_venv()
    inputs = root / "inputs"
    if not (inputs / "tok" / "base").is_dir():
        build_inputs(inputs)
    build_tokenizer_inputs(inputs)
    manifest = json.loads((COMMITTED / "MANIFEST.json").read_text())
    every = cases()
    results = {name: run_case(bin_dir, name, every[name], inputs, root) for name in names}
    fresh = [n for n, e in results.items() if "failed" not in e and n not in manifest["cases"]]
    logits = _logits(bin_dir, [root / "runs" / n / "out" for n in fresh]) if fresh else {}
    for name, entry in results.items():
        if "failed" in entry:
            manifest["failed"][name] = entry["failed"]
            continue
        if name in manifest["cases"]:  # recorded before: keep its digests, add the tokenizer record
            if "tokenizer" in entry:
                manifest["cases"][name]["tokenizer"] = entry["tokenizer"]
            continue
        values = logits[str(root / "runs" / name / "out")]
        entry["logits"] = {"input_ids": LOGITS_INPUT, **({"values": values} if isinstance(values, list) else {"error": values})}
        manifest["cases"][name] = entry
        (COMMITTED / "configs" / f"{name}.yml").write_text(yaml.safe_dump(every[name], sort_keys=False))
    manifest["inputs"].update({k: v for k, v in input_digests(inputs).items() if k in TOKENIZER_MODELS})
    (COMMITTED / "MANIFEST.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    print("added:", ", ".join(results), "failed:", ", ".join(manifest["failed"]) or "none")
    return 0


def venv_dir() -> Path:
    """mergekit's venv: `.cache/fixtures/venv-mergekit-<ver>-torch-<ver>/`."""
    return CACHE / f"venv-mergekit-{MERGEKIT}-torch-{TORCH}"


def build_venv() -> Path:
    """mergekit's venv (torch CPU, mergekit from PyPI); returns its bin folder."""
    import venv

    where = venv_dir()
    py = where / "bin" / "python"
    if not (where / "bin" / "mergekit-yaml").exists():
        venv.create(where, with_pip=True, clear=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", f"torch=={TORCH}", "--index-url",
                        "https://download.pytorch.org/whl/cpu"], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", f"mergekit=={MERGEKIT}"], check=True)
    return where / "bin"


def fixture_root() -> Path:
    """This machine's build folder (without building anything)."""
    return CACHE / f"mergekit-{MERGEKIT}-torch-{TORCH}-v{FIXTURE_VERSION}"


def _tools(bin_dir: Path) -> dict[str, str]:
    code = "import importlib.metadata as m; print(*(f'{p} {m.version(p)}' for p in ('mergekit','torch','transformers')), sep='\\n')"
    text = subprocess.run([str(bin_dir / "python"), "-c", code], capture_output=True, text=True, check=True).stdout
    return dict(line.split(" ", 1) for line in text.splitlines() if line.strip())


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return env


def _absolute(config: dict, inputs: Path) -> dict:
    """The config with model paths under `inputs` (mergekit reads them relative to its working folder otherwise)."""
    def fix(value):
        if isinstance(value, dict):
            return {k: (str(inputs / v) if (k in ("model", "base_model") or k == "source" and v not in ("base", "union"))
                        and isinstance(v, str) else fix(v)) for k, v in value.items()}
        if isinstance(value, list):
            return [fix(v) for v in value]
        return value
    out = fix(config)
    if out.get("tokenizer_source") not in (None, "base", "union"):
        out["tokenizer_source"] = str(inputs / out["tokenizer_source"])
    return out


def run_case(bin_dir: Path, name: str, config: dict, inputs: Path, root: Path) -> dict:
    """Run mergekit-yaml on one case (reusing an output made from the same config text); its manifest entry
    without the logits."""
    import yaml

    work = root / "runs" / name
    text = yaml.safe_dump(_absolute(config, inputs), sort_keys=False)
    out = work / "out"
    if not ((work / "config.yml").is_file() and (work / "config.yml").read_text() == text and (out / "config.json").is_file()):
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        (work / "config.yml").write_text(text)
        done = subprocess.run([str(bin_dir / "mergekit-yaml"), str(work / "config.yml"), str(out), "--lazy-unpickle",
                               "--no-copy-tokenizer", "--clone-tensors", "--random-seed", str(SEED), "--quiet"],
                              env=_env(), capture_output=True, text=True)
        if done.returncode != 0:
            shutil.rmtree(out, ignore_errors=True)
            return {"failed": (done.stderr.strip().splitlines() or ["?"])[-1]}
    cfg = json.loads((out / "config.json").read_text())
    entry = {"config": f"configs/{name}.yml", "seed": SEED, "random": config["merge_method"] in RANDOM,
             "tensors": tensor_digests(out),
             "output_config": {k: cfg.get(k) for k in ("num_hidden_layers", "vocab_size", "dtype")}}
    if entry["random"]:
        entry["statistics"] = delta_statistics(out, inputs / config["base_model"])
    if any(key in config for key in TOKENIZER_KEYS):
        entry["tokenizer"] = tokenizer_record(out)
    return entry


def delta_statistics(out: Path, base: Path) -> dict[str, float]:
    """What a random merge (DARE, DELLA) keeps, over all its tensors: the fraction of elements that differ from the
    base model's, and the mean absolute difference (the tests compare these where the draws differ)."""
    from safetensors.torch import load_file

    merged = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    reference = {k: v for f in sorted(base.glob("*.safetensors")) for k, v in load_file(f).items()}
    changed = total = 0
    delta = 0.0
    for name, tensor in merged.items():
        diff = tensor.float() - reference[name].float()
        changed += int((diff != 0).sum())
        total += diff.numel()
        delta += float(diff.abs().sum())
    return {"changed_fraction": round(changed / total, 6), "mean_abs_delta": float("%.6g" % (delta / total))}


def _logits(bin_dir: Path, folders: list[Path]) -> dict[str, object]:
    """folder -> logits (or the error) of each merged model, in one process (transformers loads once)."""
    done = subprocess.run([str(bin_dir / "python"), "-c", LOGITS, json.dumps(LOGITS_INPUT), *map(str, folders)],
                          env=_env(), capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def build(root: Path, only: set[str] | None = None) -> Path:
    """Build the inputs and run every case under root; the result is root/manifest.json (no-op when done)."""
    if (root / "manifest.json").exists() and not only:
        return root
    bin_dir = build_venv()
    inputs = build_inputs(root / "inputs")
    results = {}
    for name, config in cases().items():
        if only is not None and name not in only:
            continue
        print("mergekit:", name, flush=True)
        results[name] = run_case(bin_dir, name, config, inputs, root)
    built = [name for name, entry in results.items() if "failed" not in entry]
    logits = _logits(bin_dir, [root / "runs" / name / "out" for name in built])
    for name in built:
        values = logits[str(root / "runs" / name / "out")]
        results[name]["logits"] = {"input_ids": LOGITS_INPUT, **({"values": values} if isinstance(values, list) else {"error": values})}
    manifest = {"format": FORMAT, "made_by": f"scripts/{Path(__file__).name} (fixture version {FIXTURE_VERSION})",
                "tools": _tools(bin_dir), "seed": SEED, "inputs": input_digests(inputs),
                "cases": {k: v for k, v in results.items() if "failed" not in v},
                "failed": {k: v["failed"] for k, v in results.items() if "failed" in v}}
    (root / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return root


def commit(root: Path) -> None:
    """Replace tests/fixtures/mergekit/ with this build's configs and manifest."""
    import yaml

    manifest = json.loads((root / "manifest.json").read_text())
    shutil.rmtree(COMMITTED, ignore_errors=True)
    (COMMITTED / "configs").mkdir(parents=True)
    for name, config in cases().items():
        (COMMITTED / "configs" / f"{name}.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    (COMMITTED / "MANIFEST.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    (COMMITTED / "done").write_text("".join(f"{k} {v}\n" for k, v in sorted(manifest["tools"].items())))
    print(COMMITTED)


def main() -> int:
    if "--print-root" in sys.argv:
        print(COMMITTED)
        return 0
    root = fixture_root()
    if "--print-built-root" in sys.argv:
        print(root)
        return 0
    if "--add" in sys.argv:  # python scripts/make_mergekit_fixtures.py --add CASE,CASE (tokenizer cases)
        return add_cases(sys.argv[sys.argv.index("--add") + 1].split(","))
    only = set(sys.argv[sys.argv.index("--only") + 1].split(",")) if "--only" in sys.argv else None
    try:
        root = build(root, only)
    except (subprocess.CalledProcessError, OSError) as exc:
        print(f"warning: could not build the mergekit fixtures ({exc}); their rebuild check will fail", file=sys.stderr)
        return 1
    if "--commit" in sys.argv:
        commit(root)
    print(root)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
