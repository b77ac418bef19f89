"""One validated reading of a PEFT `adapter_config.json`, before any of its values is used.

Adapters come from the internet: a value no trained adapter has (`r: 0`, `lora_alpha: NaN`, `"16"` as a
string, a 100,000-deep nesting, a pattern that is not a regular expression) must become a clear message
naming the file and the key, never a Python exception from deep inside the merge nor a silently
non-finite weight. `read_config` reads the file (JSON errors, nesting, not an object: `MapperError`);
`validate` checks the values the merge uses and returns them typed (`AdapterSettings`) with the list of
problems, one sentence each, naming the key. `init_lora_weights` is interpreted here too: how a saved
adapter's initialisation changes the base it is applied to (see `base_change`).
"""

from __future__ import annotations

import json
import math
import re
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import MapperError

CONFIG_FILE = "adapter_config.json"
MAX_CONFIG_BYTES = 16 * 2**20  # PEFT writes a few KB; rank/alpha patterns of a huge model stay well under this
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlist, _SHORT.maxdict = 3, 60, 60, 4, 4

# init_lora_weights values after which PEFT applies the saved adapter to the base unchanged (the init only
# chose lora_A / lora_B's starting values, which the saved tensors replace).
PLAIN_INITS = (True, False, None, "gaussian", "eva", "orthogonal")
# values whose init subtracted a part of the base that PEFT recomputes from the base on loading; reproduced.
RESIDUAL_INITS = ("pissa", "olora")
# values PEFT's loading cannot or does not reproduce deterministically: refused, with why.
REFUSED_INITS = {
    "pissa_niter_": "its residual base comes from a randomised SVD (torch.svd_lowrank), which PEFT recomputes with the "
                    "process's random state on each load, so no merge can reproduce it",
    "corda": "its residual base comes from CorDA's covariance of calibration data (preprocess_corda), which is not "
             "in the adapter",
    "loftq": "it was trained against LoftQ's quantised base (PEFT quantises the base again on loading), which is not in "
             "the adapter",
}
_CONVERT = ("Save it converted to a plain LoRA with PEFT (save_pretrained(..., path_initial_model_for_weight_conversion=...)), "
            "or merge it with PEFT onto the base it was trained against.")


def short(value: Any) -> str:
    """A bounded repr of a config value for messages (deep or long values are cut, never recursed into)."""
    return _SHORT.repr(value)


def read_config(config_path: Path, fix: str = "Re-save the adapter with PEFT (save_pretrained).") -> dict[str, Any]:
    """The JSON object in `config_path` (an adapter's, or a base model's config.json with its own `fix`); a
    `MapperError` naming the file for anything else."""
    try:
        with open(config_path, "rb") as handle:
            raw = handle.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise MapperError(f"Cannot read {config_path.parent}: {config_path.name} is missing. Point at the folder "
                          "save_pretrained wrote.", file=str(config_path)) from None
    except OSError as exc:
        raise MapperError(f"Cannot read {config_path}: {exc.strerror or exc}. {fix}", file=str(config_path)) from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise MapperError(f"Cannot read {config_path}: it is larger than {MAX_CONFIG_BYTES} bytes, far more than any "
                          f"model or adapter config. {fix}", file=str(config_path))
    try:
        config = json.loads(raw)
    except RecursionError:
        raise MapperError(f"Cannot read {config_path}: its JSON is nested too deeply to be a model or adapter config. {fix}",
                          file=str(config_path)) from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise MapperError(f"Cannot read {config_path}: it is not valid JSON ({exc}). {fix}", file=str(config_path)) from None
    if not isinstance(config, dict):
        raise MapperError(f"Cannot read {config_path}: it is a JSON {type(config).__name__}, not an object. {fix}",
                          file=str(config_path))
    return config


@dataclass
class AdapterSettings:
    """The values of an adapter config that the merge uses, checked (see `validate`)."""

    r: int = 8
    alpha: float = 8
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    use_rslora: bool = False
    use_dora: bool = False
    fan_in_fan_out: bool = False
    lora_bias: bool = False
    bias: str = "none"
    init: str | None = None  # "pissa" / "olora": the base loses its top-r part first (see base_change); None: plain
    problems: list[str] = field(default_factory=list)

    def rank_alpha(self, module: str) -> tuple[int, float]:
        """(r, lora_alpha) for `module`: the patterns' first matching key (PEFT's rule), else the defaults."""
        rank_key, alpha_key = pattern_key(self.rank_pattern, module), pattern_key(self.alpha_pattern, module)
        r = self.rank_pattern[rank_key] if rank_key is not None else self.r
        alpha = self.alpha_pattern[alpha_key] if alpha_key is not None else self.alpha
        return r, alpha

    def scale(self, module: str) -> float:
        """PEFT's scaling for `module`: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        r, alpha = self.rank_alpha(module)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


def pattern_key(patterns: Mapping[str, Any], module: str) -> str | None:
    """The key of `patterns` that applies to `module`, by PEFT's rule: `(.*\\.)?(key)$` matches the module name."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _rank_problem(key: str, value: Any) -> str | None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        return f"{key} is {short(value)}, not a positive whole number (the LoRA rank)"
    return None


def _alpha_problem(key: str, value: Any) -> str | None:
    if not _number(value) or not math.isfinite(value) or value <= 0:
        return f"{key} is {short(value)}, not a finite positive number (LoRA's alpha scales the update)"
    return None


def _pattern(config: Mapping[str, Any], key: str, check: Any, problems: list[str]) -> dict[str, Any]:
    value = config.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        problems.append(f"{key} is {short(value)}, not an object of module pattern -> value")
        return {}
    good: dict[str, Any] = {}
    for pattern, item in value.items():
        try:
            re.compile(rf"(.*\.)?({pattern})$")
        except (re.error, RecursionError, OverflowError) as exc:
            problems.append(f"{key} has the key {short(pattern)}, which is not a regular expression ({exc})")
            continue
        problem = check(f"{key}[{short(pattern)}]", item)
        if problem:
            problems.append(problem)
        else:
            good[pattern] = item
    return good


def _flag(config: Mapping[str, Any], key: str, problems: list[str]) -> bool:
    value = config.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        problems.append(f"{key} is {short(value)}, not true or false")
        return False
    return value


def base_change(init: Any) -> tuple[str | None, str | None]:
    """(how the base changes, why it is refused) for an `init_lora_weights` value of a saved adapter.

    PEFT re-runs the initialisation when it loads a saved adapter onto a base: for PiSSA and OLoRA that
    subtracts the base's top-r part (an SVD, a QR) from each target weight before the trained adapter is
    added; the other plain inits leave the base as it is. A converted adapter
    (`path_initial_model_for_weight_conversion`) is saved with `init_lora_weights: true`.
    """
    if isinstance(init, str) and init.lower() in ("gaussian", "olora"):  # PEFT compares these two case-insensitively
        init = init.lower()
    if init in PLAIN_INITS:
        return None, None
    if isinstance(init, str):
        if init in RESIDUAL_INITS:
            return init, None
        for prefix, why in REFUSED_INITS.items():
            if init.startswith(prefix):
                return None, f"init_lora_weights is {short(init)}: {why}. {_CONVERT}"
    return None, (f"init_lora_weights is {short(init)}, which lora_merge does not know (it may change the base the adapter "
                  f"applies to). {_CONVERT}")


def validate(config: Mapping[str, Any]) -> AdapterSettings:
    """The merge's settings from `config`, with a problem (naming the key) for every value no adapter can have."""
    problems: list[str] = []
    settings = AdapterSettings(problems=problems)
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        problems.append(f"its peft_type is {short(peft_type)}, only 'LORA' adapters can be merged")
    r, alpha = config.get("r", 8), config.get("lora_alpha", 8)
    for problem in (_rank_problem("r", r), _alpha_problem("lora_alpha", alpha)):
        if problem:
            problems.append(problem)
    if not any(p.startswith("r ") for p in problems):
        settings.r = r
    if not any(p.startswith("lora_alpha ") for p in problems):
        settings.alpha = alpha
    settings.rank_pattern = _pattern(config, "rank_pattern", _rank_problem, problems)
    settings.alpha_pattern = _pattern(config, "alpha_pattern", _alpha_problem, problems)
    for name in ("use_rslora", "use_dora", "fan_in_fan_out", "lora_bias"):
        setattr(settings, name, _flag(config, name, problems))
    bias = config.get("bias", "none")
    if bias not in ("none", "all", "lora_only", None):
        problems.append(f"bias is {short(bias)}, not 'none', 'all' or 'lora_only'")
    else:
        settings.bias = bias or "none"
    init, refused = base_change(config.get("init_lora_weights", True))
    if refused:
        problems.append(refused)
    settings.init = init
    return settings
