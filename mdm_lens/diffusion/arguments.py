"""Every `generate` argument checked (types, ranges, combinations) and resolved to the value the sampler runs with,
before any compute. Errors are the typed ones of `mdm_lens.errors` (raised through `mdm_lens.validate`).

Defaults follow the reference samplers as users run them (architectures.md §2.5, §4.4):

* LLaDA `generate.py`: temperature 0, cfg_scale 0, low-confidence remasking, one block.
* Dream `diffusion_generate` with no `generation_config`: the unset sampling settings come from the model config's
  legacy generation attributes (transformers 4.x `PretrainedConfig`: temperature 1.0, top_p 1.0, top_k 50),
  not from `DreamGenerationConfig`'s own defaults (0.0 / None / None) and not from the checkpoint's
  generation_config.json. So an unset `temperature` samples at 1.0 under a top-50 filter, exactly as there.
  Pass `top_k=None` (or `top_p=None`) explicitly to switch a filter off, as in the reference.
* ARM: greedy (temperature 0, no filters).

`steps` defaults to `gen_length` (LLaDA's official setting; Dream's function default of 512 steps does not depend
on the length). `gen_length` defaults to the canvas a zoo twin was trained on (`cfg.extra["gen_length"]`), else 32.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from mdm_lens import validate
from mdm_lens.errors import ArgumentTypeError, InputError, SamplerConfigError

SAMPLERS = ("llada", "dream", "arm")
REMASKING = ("low_confidence", "random")
DREAM_ALGORITHMS = ("origin", "maskgit_plus", "topk_margin", "entropy")
DEFAULT_GEN_LENGTH = 32
# Dream's unset sampling settings: transformers 4.x PretrainedConfig legacy generation defaults.
DREAM_LEGACY_DEFAULTS = dict(temperature=1.0, top_p=1.0, top_k=50)


class _Default:
    """The sentinel of an unset argument: the chosen sampler's reference default applies."""

    def __repr__(self) -> str:
        return "DEFAULT"

    def __bool__(self) -> bool:
        return False


DEFAULT: Any = _Default()


class IdleStepsWarning(UserWarning):
    """More steps than tokens: some denoising steps commit nothing (the reference runs them anyway)."""


# Options one sampler has and the others do not, with the value under which they do nothing. Giving another
# sampler a non-neutral value is an error: it would be silently ignored.
_OWN = {
    "llada": {"cfg_scale": 0.0, "remasking": "low_confidence", "logits_eos_inf": False,
              "confidence_eos_eot_inf": False, "block_length": None},
    "dream": {"alg": "origin", "alg_temp": None, "eps": 1e-3},
    "arm": {"stop_at_eos": False},
}
_FILTERS = ("top_p", "top_k")  # dream and arm


@dataclass
class Settings:
    sampler: str
    steps: int
    gen_length: int
    values: dict[str, Any]  # every effective sampler setting, shown on `out.settings`


def _optional(value: Any, check: Callable[[Any], Any]) -> Any:
    return None if value is None else check(value)


def check_unused(sampler: str, given: dict[str, Any]) -> None:
    """A sampler-specific option passed (non-neutral) to a sampler that does not have it."""
    for other, options in _OWN.items():
        if other == sampler:
            continue
        for name, neutral in options.items():
            value = given[name]
            if value is DEFAULT or value is neutral or (neutral is not None and value == neutral):
                continue
            if name == "block_length" and value == given["gen_length"]:  # one block: what the others do
                continue
            raise SamplerConfigError(f"{name}={value!r} is a {other} sampler option; the {sampler} sampler has no "
                                     f"such setting and would ignore it.", argument=name, value=value,
                                     allowed=f"only with sampler='{other}'")
    if sampler == "llada":
        for name in _FILTERS:
            if given[name] is not DEFAULT and given[name] is not None:
                raise SamplerConfigError(f"{name}={given[name]!r}: the LLaDA sampler has no {name} filter "
                                         "(its temperature samples the full distribution).", argument=name,
                                         value=given[name], allowed="only with sampler='dream' or 'arm'")


def _or(value: Any, default: Any) -> Any:
    return default if value is DEFAULT else value


def resolve(model: Any, sampler: str, given: dict[str, Any]) -> Settings:
    """Validate and resolve the sampler settings in `given` (the `generate` keyword arguments)."""
    check_unused(sampler, given)
    gl = given["gen_length"]
    if gl is None or gl is DEFAULT:
        gl = model.cfg.extra.get("gen_length", DEFAULT_GEN_LENGTH)
    gen_length = validate.integer(gl, name="gen_length", min=1, error=SamplerConfigError)
    steps_arg = given["steps"]
    steps = gen_length if steps_arg is None else validate.integer(steps_arg, name="steps", min=1,
                                                                  error=SamplerConfigError)
    reference_t = DREAM_LEGACY_DEFAULTS["temperature"] if sampler == "dream" else 0.0
    t = given["temperature"]
    temperature = validate.number(reference_t if t is None or t is DEFAULT else t, name="temperature", min=0,
                                  error=SamplerConfigError)
    values: dict[str, Any] = dict(temperature=temperature)
    if sampler == "llada":
        bl = _or(given["block_length"], None)
        block_length = gen_length if bl is None else validate.integer(bl, name="block_length", min=1,
                                                                      error=SamplerConfigError)
        _llada_combination(steps, gen_length, block_length)
        values.update(block_length=block_length,
                      remasking=validate.choice(_or(given["remasking"], "low_confidence"), REMASKING,
                                                name="remasking", error=SamplerConfigError),
                      cfg_scale=validate.number(_or(given["cfg_scale"], 0.0), name="cfg_scale", min=0,
                                                error=SamplerConfigError),
                      logits_eos_inf=validate.boolean(_or(given["logits_eos_inf"], False), name="logits_eos_inf"),
                      confidence_eos_eot_inf=validate.boolean(_or(given["confidence_eos_eot_inf"], False),
                                                              name="confidence_eos_eot_inf"))
        values.update(_special_ids(model, values))
    elif sampler == "dream":
        values.update(alg=validate.choice(_or(given["alg"], "origin"), DREAM_ALGORITHMS, name="alg",
                                          error=SamplerConfigError),
                      alg_temp=_optional(_or(given["alg_temp"], None),
                                         lambda v: validate.number(v, name="alg_temp", min=0,
                                                                   error=SamplerConfigError)),
                      eps=validate.number(_or(given["eps"], 1e-3), name="eps", min=0, max=1, min_open=True,
                                          max_open=True, error=SamplerConfigError))
        values.update(_filters(given, DREAM_LEGACY_DEFAULTS))
    else:
        if steps != gen_length:
            raise SamplerConfigError(f"steps={steps} but an ARM takes one step per token: steps must equal "
                                     f"gen_length={gen_length} (or be left unset).", argument="steps", value=steps,
                                     allowed=f"{gen_length}")
        values.update(_filters(given, dict(top_p=None, top_k=None)))
        values["stop_at_eos"] = validate.boolean(_or(given["stop_at_eos"], False), name="stop_at_eos")
        if values["stop_at_eos"] and model.cfg.eos_token_id is None:
            raise SamplerConfigError("stop_at_eos=True but the model has no EOS id (cfg.eos_token_id is None).",
                                     argument="stop_at_eos", value=True, allowed="a model with cfg.eos_token_id")
    return Settings(sampler, steps, gen_length, values)


def _filters(given: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    top_p = _or(given["top_p"], defaults["top_p"])
    top_k = _or(given["top_k"], defaults["top_k"])
    top_p = _optional(top_p, lambda v: validate.number(v, name="top_p", min=0, max=1, min_open=True,
                                                       error=SamplerConfigError))
    top_k = _optional(top_k, lambda v: validate.integer(v, name="top_k", min=1, error=SamplerConfigError))
    return dict(top_p=top_p, top_k=top_k)


def _llada_combination(steps: int, gen_length: int, block_length: int) -> None:
    if gen_length % block_length:
        raise SamplerConfigError(f"gen_length={gen_length} is not a multiple of block_length={block_length}; "
                                 "LLaDA decodes whole blocks. Use block_length=gen_length for no blocks.",
                                 argument="block_length", value=block_length, allowed=f"a divisor of {gen_length}")
    n_blocks = gen_length // block_length
    if steps % n_blocks:
        raise SamplerConfigError(f"steps={steps} must be divisible by the number of blocks {n_blocks} "
                                 f"(gen_length/block_length); e.g. steps={n_blocks * max(1, steps // n_blocks)}.",
                                 argument="steps", value=steps, allowed=f"a multiple of {n_blocks}")


def _special_ids(model: Any, values: dict[str, Any]) -> dict[str, Any]:
    """EOS / EoT ids for LLaDA's suppression options, from the checkpoint (filled by the loaders).

    The reference line `logits_with_noise[..., EOS] = logits[..., EoT] = -inf` touches EoT always and EOS only at
    temperature 0 (where the noised logits are the logits themselves); an id the option would touch must be known."""
    eos = model.cfg.eos_token_id
    eot = model.cfg.extra.get("eot_token_id")
    if eot is None:
        eot = model.cfg.extra.get("special_tokens", {}).get("<|eot_id|>")
    if values["logits_eos_inf"] and eos is None:
        raise SamplerConfigError("logits_eos_inf=True but the model's EOS id is unknown (cfg.eos_token_id is None); "
                                 "set it from the tokenizer.", argument="logits_eos_inf", value=True,
                                 allowed="a model with cfg.eos_token_id")
    if values["confidence_eos_eot_inf"]:
        missing = ["EoT (cfg.extra['eot_token_id'])"] if eot is None else []
        if values["temperature"] == 0 and eos is None:
            missing.append("EOS (cfg.eos_token_id)")
        if missing:
            raise SamplerConfigError(f"confidence_eos_eot_inf=True needs the {' and '.join(missing)} id, unknown "
                                     "for this model; set it from the checkpoint's tokenizer.",
                                     argument="confidence_eos_eot_inf", value=True, allowed="a model with EOS/EoT ids")
    return dict(eos_id=eos, eot_id=eot)


def idle_steps(sampler: str, steps: int, gen_length: int, values: dict[str, Any]) -> list[int] | None:
    """The steps that commit no token when steps > gen_length (None: not deterministic, Dream `origin`)."""
    from mdm_lens.diffusion.schedules import dream_schedule, llada_transfer_counts

    if sampler == "llada":
        bl = values["block_length"]
        spb = steps // (gen_length // bl)
        counts = llada_transfer_counts(torch.ones(1, bl, dtype=torch.bool), spb)[0].tolist() * (gen_length // bl)
        return [s for s, c in enumerate(counts) if c == 0]
    if sampler == "dream" and values["alg"] != "origin":
        return [s for s, c in enumerate(dream_schedule(gen_length, steps, values["eps"])) if c == 0]
    return None


def warn_idle(sampler: str, steps: int, gen_length: int, values: dict[str, Any]) -> None:
    """steps > gen_length runs as in the reference, with a warning that names the steps that commit nothing."""
    if steps <= gen_length:
        return
    idle = idle_steps(sampler, steps, gen_length, values)
    which = ("some steps commit nothing (origin unmasks at random)" if idle is None
             else f"steps {_short(idle)} commit no token")
    warnings.warn(f"steps={steps} > gen_length={gen_length}: {which}; they still run a forward pass and fire "
                  "their hooks. Use steps <= gen_length to avoid idle steps.", IdleStepsWarning, stacklevel=3)


def _short(items: list[int]) -> str:
    return str(items) if len(items) <= 12 else f"{items[:8]}... ({len(items)} in all)"


def prompt_tokens(model: Any, prompt: Any, attention_mask: Any) -> tuple[Tensor, Tensor]:
    """The prompt as `[batch, pos]` ids and a left-padded 0/1 attention mask, checked."""
    if isinstance(prompt, str) or (isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], str)):
        if isinstance(prompt, str) and not prompt:
            raise InputError("prompt='' is empty; give at least one token.", argument="prompt", value=prompt,
                             allowed="a non-empty text or token ids")
        if attention_mask is not None:
            raise InputError("attention_mask is built by the tokenizer for text prompts; pass token ids to give "
                             "your own.", argument="attention_mask", value=attention_mask, allowed="None")
        ids, am = model.to_tokens(prompt, return_attention_mask=True)
    else:
        if isinstance(prompt, (list, tuple)) and len(prompt) == 0:
            raise InputError("prompt=[] is empty; give at least one token.", argument="prompt", value=prompt,
                             allowed="a non-empty text or token ids")
        if isinstance(prompt, (list, tuple)) and not isinstance(prompt, Tensor):
            try:
                prompt = torch.as_tensor(prompt)
            except (TypeError, ValueError) as err:
                raise ArgumentTypeError(f"prompt must be text or token ids [batch, pos] ({err}).", argument="prompt",
                                        value=prompt, allowed="str, list of str, or int token ids") from None
        ids = validate.tensor(prompt, name="prompt", ndim=(1, 2), dtype="int", nonempty=False)
        ids = (ids[None] if ids.ndim == 1 else ids).to(model.input_device)
        if attention_mask is None:
            am = torch.ones_like(ids)
        else:
            am = validate.tensor(attention_mask, name="attention_mask", dtype=("int", "bool"), nonempty=False)
            am = am[None] if am.ndim == 1 else am
            validate.same_shape(ids, am, names=("prompt", "attention_mask"))
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        raise InputError(f"prompt of shape {tuple(ids.shape)} is empty; give at least one token per row.",
                         argument="prompt", value=ids, allowed="a [batch >= 1, pos >= 1] prompt")
    return ids.long(), check_padding(am.to(ids.device).long())


def check_padding(am: Tensor) -> Tensor:
    """0/1 values, at least one real token per row, padding on the left only (the canvas follows the prompt)."""
    if bool(((am != 0) & (am != 1)).any()):
        raise InputError("attention_mask must hold 0 (pad) and 1 (token) only.", argument="attention_mask", value=am,
                         allowed="values in {0, 1}")
    empty = (am.sum(-1) == 0).nonzero().flatten().tolist()
    if empty:
        raise InputError(f"attention_mask rows {empty} are all zero: those prompts have no token.",
                         argument="attention_mask", value=am, allowed="at least one 1 per row")
    not_left = (am[:, 1:] < am[:, :-1]).any(-1).nonzero().flatten().tolist()
    if not_left:
        raise InputError(f"prompt rows {not_left} are not left-padded (a pad follows a token). The canvas is "
                         "appended after the prompt, so pad on the left: model.to_tokens(..., padding_side='left').",
                         argument="attention_mask", value=am, allowed="left padding (zeros, then ones)")
    return am
