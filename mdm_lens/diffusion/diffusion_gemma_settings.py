"""DiffusionGemma's generation settings (transformers' names), their rules, and their resolution through
transformers (`prepare_settings`); the step-by-step loop is in `mdm_lens.diffusion.diffusion_gemma`.

transformers' `DiffusionGemmaGenerationConfig.validate` checks only some ranges, and some of its checks let NaN
through (`t_min < 0` is False for NaN), format a missing attribute in their message (its `stability_threshold` and
`confidence_threshold` checks raise an AttributeError), or refuse an int where a float is meant. So every setting is
checked here first, by the rules table (`mdm_lens.diffusion.rules`), for the values passed to the call, and again
on the resolved config (generation_config=, the model's generation config and transformers' defaults fill the
rest), where the token ids are checked against the model's vocabulary. What transformers accepts is still accepted
(an int `confidence_threshold` is handed on as the float it means), so runs stay token-exact.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from mdm_lens import validate
from mdm_lens.diffusion import rules as R
from mdm_lens.diffusion.registry import DEFAULT, SamplerSettings
from mdm_lens.errors import SamplerConfigError

_ERR = SamplerConfigError


@dataclass
class DiffusionGemmaSettings(SamplerSettings):
    """transformers' generation settings by their own names; an unset one (DEFAULT) resolves as transformers does:
    the call, then `generation_config`, then the model's generation config, then the global defaults (an explicit
    None is passed on: e.g. `stability_threshold=None` turns adaptive stopping off, as in transformers).
    `entropy_bound` is a shortcut for `sampler_config=EntropyBoundSamplerConfig(entropy_bound=...)`."""

    max_new_tokens: int | None = DEFAULT
    max_length: int | None = DEFAULT
    max_denoising_steps: int | None = DEFAULT
    sampler_config: Any = DEFAULT
    entropy_bound: float | None = DEFAULT
    t_min: float | None = DEFAULT
    t_max: float | None = DEFAULT
    stability_threshold: float | None = DEFAULT
    confidence_threshold: float | None = DEFAULT
    eos_token_id: Any = DEFAULT
    pad_token_id: int | None = DEFAULT
    bos_token_id: int | None = DEFAULT
    cache_implementation: str | None = DEFAULT
    generation_config: Any = DEFAULT


def _sampler_config(value: Any, name: str) -> Any:
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

    if not isinstance(value, EntropyBoundSamplerConfig):
        raise _ERR(f"{name}={validate.describe(value)} is invalid: expected an EntropyBoundSamplerConfig (or pass the "
                   "shortcut entropy_bound=).", argument=name, value=value, allowed="an EntropyBoundSamplerConfig")
    # transformers' own check (`entropy_bound <= 0`) lets NaN through, which then changes which samples are kept
    validate.number(value.entropy_bound, name="entropy_bound", min=0, min_open=True, error=_ERR)
    return value


def _generation_config(value: Any, name: str) -> Any:
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import DiffusionGemmaGenerationConfig

    if value is not None and not isinstance(value, DiffusionGemmaGenerationConfig):
        raise _ERR(f"{name}={validate.describe(value)} is invalid: expected None or a DiffusionGemmaGenerationConfig.",
                   argument=name, value=value, allowed="None or a DiffusionGemmaGenerationConfig")
    return value


def _cache(value: Any, name: str) -> Any:
    if value not in (None, "dynamic") or not (value is None or isinstance(value, str)):
        raise _ERR(f"{name}={validate.describe(value)}: the step-by-step sampler runs with a dynamic cache only "
                   "(static caches exist for torch.compile).", argument=name, value=value, allowed="None or 'dynamic'")
    return value


def _token_ids(value: Any, name: str) -> Any:
    """`eos_token_id`: None, one id or a non-empty list of them (each >= 0; the vocabulary is checked on resolve)."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise _ERR(f"{name}=[] is invalid: pass None to turn EOS stopping off, or at least one id.",
                       argument=name, value=value, allowed="None, a token id or a non-empty list of them")
        return [validate.integer(v, name=name, min=0, error=_ERR) for v in value]
    return None if value is None else validate.integer(value, name=name, min=0, error=_ERR)


_IDS = "token id(s) >= 0 and < the model's d_vocab"
# what each setting accepts; explicit None where transformers' loop has no use for it (range(None) steps, no sampler
# config, `max_new_tokens=None` which its length resolution cannot read) is refused, not handed on to crash
DiffusionGemmaSettings.rules = {
    "max_new_tokens": R.integer(1), "max_length": R.integer(1, none=True), "max_denoising_steps": R.integer(1),
    "sampler_config": R.Rule(_sampler_config, "an EntropyBoundSamplerConfig with a finite entropy_bound > 0",
                             (None, 0.1, {"entropy_bound": 0.1})),
    "entropy_bound": R.number(0, low_open=True, none=True),
    "t_min": R.number(0, none=True), "t_max": R.number(0, none=True),
    "stability_threshold": R.integer(0, none=True), "confidence_threshold": R.number(0, low_open=True, none=True),
    "eos_token_id": R.Rule(_token_ids, f"None, or one or a non-empty list of {_IDS}",
                           (-5, 2.5, "1", True, [], [1, -1])),
    "pad_token_id": R.integer(0, none=True), "bos_token_id": R.integer(0, none=True),
    "cache_implementation": R.Rule(_cache, "None or 'dynamic'", ("static", 3)),
    "generation_config": R.Rule(_generation_config, "None or a DiffusionGemmaGenerationConfig", ({"t_min": 0.4}, 3)),
}

# transformers' own generation settings: the dataclass's fields less our two conveniences (one list, not two)
GENERATION_SETTINGS = tuple(f.name for f in dataclasses.fields(DiffusionGemmaSettings)
                            if f.name not in ("entropy_bound", "generation_config"))
_TOKEN_IDS = ("eos_token_id", "pad_token_id", "bos_token_id")
_SOURCE = "(resolved from the call, generation_config=, the model's generation config or transformers' defaults)"


def check_given(settings: dict[str, Any]) -> dict[str, Any]:
    """The call's settings by their rules, normalised as transformers needs them (a float `confidence_threshold`,
    plain ints): the value checked is the value passed on."""
    return {k: DiffusionGemmaSettings.rules[k].check(v, k) for k, v in settings.items()}


def _t_order(t_min: Any, t_max: Any, source: str = "") -> None:
    if t_min is not None and t_max is not None and t_max <= t_min:
        raise _ERR(f"t_max={t_max!r} is invalid: the temperature schedule runs from t_max down to t_min={t_min!r}, "
                   f"so t_max must exceed t_min{source}.", argument="t_max", value=t_max,
                   allowed=f"a finite number > t_min={t_min!r}")


def check_resolved(gc: Any, d_vocab: int | None) -> None:
    """The settings transformers resolved (also those from generation_config= and the model's generation config,
    which no call rule saw): every range, t_max > t_min, and token ids inside the vocabulary."""
    rules = DiffusionGemmaSettings.rules
    for name in GENERATION_SETTINGS:
        value = getattr(gc, name, None)
        try:
            rules[name].check(value, name)
        except SamplerConfigError as e:
            raise type(e)(f"{str(e).rstrip('.')} {_SOURCE}.", argument=name, value=value, allowed=e.allowed) from None
    _t_order(gc.t_min, gc.t_max, f" {_SOURCE}")
    if d_vocab is None:
        return
    for name in _TOKEN_IDS:
        value = getattr(gc, name, None)
        for v in (value if isinstance(value, (list, tuple)) else [value]):
            if v is not None and not 0 <= v < d_vocab:
                # an id outside the vocabulary never matches a sampled token (EOS stopping silently off) or writes
                # an invalid id into the output (pad)
                raise _ERR(f"{name}={validate.describe(value)} is invalid: token ids must be in [0, {d_vocab}) for "
                           f"this model's vocabulary of {d_vocab} {_SOURCE}.", argument=name, value=value,
                           allowed=f"token id(s) in [0, {d_vocab - 1}] or None")


def _culprit(message: str) -> str:
    """The setting transformers' message names (`name`), when it names one of ours."""
    found = [n for n in re.findall(r"`(\w+)`", message) if n in DiffusionGemmaSettings.rules]
    return found[0] if found else "generation_config"


def prepare_settings(hf: Any, generation_config: Any = None, d_vocab: int | None = None, **settings: Any) -> Any:
    """transformers' own resolution: call > `generation_config` > the model's > global defaults; every value
    checked by our rules before and after it (see the module docstring)."""
    unknown = sorted(set(settings) - set(GENERATION_SETTINGS))
    if unknown:
        raise SamplerConfigError(f"unknown DiffusionGemma setting(s) {unknown}; known: {list(GENERATION_SETTINGS)}.",
                                 argument=unknown[0], value=settings[unknown[0]],
                                 allowed=f"one of {list(GENERATION_SETTINGS)}")
    settings = check_given(settings)
    _t_order(settings.get("t_min"), settings.get("t_max"))
    _generation_config(generation_config, "generation_config")
    for name in GENERATION_SETTINGS:  # a generation_config's own values (set after it was built: never validated)
        value = getattr(generation_config, name, None)
        if value is not None and name not in settings:
            try:
                DiffusionGemmaSettings.rules[name].check(value, name)
            except SamplerConfigError as e:
                raise type(e)(f"{str(e).rstrip('.')} (from generation_config=).", argument=name, value=value,
                              allowed=e.allowed) from None
    try:
        gc, leftover = hf._prepare_generation_config(generation_config, **settings)
    except (ValueError, TypeError, AttributeError) as e:
        # transformers' validator on a value no rule of ours saw (set on a generation_config after it was built):
        # its ValueError, or the AttributeError / TypeError its own messages raise, as a typed error naming it
        name = _culprit(str(e)) if isinstance(e, ValueError) else next(
            (n for n in ("stability_threshold", "confidence_threshold") if n in settings
             or getattr(generation_config, n, None) is not None), "generation_config")
        raise SamplerConfigError(f"invalid DiffusionGemma setting {name}: transformers' validator refused it "
                                 f"({type(e).__name__}: {e}).", argument=name,
                                 value=settings.get(name, getattr(generation_config, name, None)),
                                 allowed=DiffusionGemmaSettings.rules[name].allowed) from e
    if leftover:
        raise SamplerConfigError(f"settings {sorted(leftover)} are not generation settings of DiffusionGemma.")
    check_resolved(gc, d_vocab)
    return gc
