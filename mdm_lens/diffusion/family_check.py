"""One check of sampler against model family, run before a sampler reads anything from the model.

A sampler run on a family it was not written for fails in one of two ways: loudly and late (the BD3LM / GIDD
settings read `block_size` / `t_eps` from a config that has none: a raw KeyError) or silently (a canvas sampler on a
time-conditioned DDiT model never sets the step's σ, so every step is denoised as if the canvas were clean data).
Both are refused here with the same `SamplerConfigError`, naming the sampler, the family and the samplers that run it.

The rule:
- a DDiT sampler (`sampler.family` set: mdlm, duo, bd3lm, gidd) runs checkpoints of its own family only;
- a sampler without σ (every other one) runs a DDiT model only when σ never reaches the network, its attention
  is the plain bidirectional one and the sampler's forward is a plain `model(canvas)`: the canvas samplers in
  `PLAIN_CANVAS` on an MDLM with `time_conditioning` off (σ is zeroed inside, so the clean σ the model falls back to
  is what it uses anyway). Duo and GIDD are always conditioned on the noise level; BD3LM is block-causal and decodes
  block by block; the other samplers hand the forward what a DDiT forward does not take (position ids, KV caches).
"""

from __future__ import annotations

from typing import Any, Iterable

from mdm_lens.errors import SamplerConfigError

DDIT_FAMILIES = ("mdlm", "duo", "bd3lm", "gidd")
PLAIN_CANVAS = ("llada", "dream", "coda", "rnd1")  # samplers whose every forward is model(canvas[, attention_mask])


def mismatch(sampler: Any, model: Any) -> str:
    """Why `sampler` was not written for `model`'s family ("" when it was)."""
    family = model.cfg.family
    own = getattr(sampler, "family", None)
    if own is not None:
        return "" if family == own else f"it runs {own} checkpoints only (its schedule and settings are {own}'s)"
    if family not in DDIT_FAMILIES:
        return ""
    if family == "bd3lm":
        return ("a BD3LM model is block-causal and is decoded block by block against the finished blocks; "
                f"sampler {sampler.name!r} fills a whole canvas")
    if model.cfg.extra.get("time_conditioning", True):
        return (f"this {family} model is conditioned on the noise level σ, which sampler {sampler.name!r} never "
                "sets: every step would be denoised at the clean σ, as if the canvas held no masks")
    if sampler.name not in PLAIN_CANVAS:
        return (f"sampler {sampler.name!r} was written for another architecture (its forwards take position ids "
                f"or caches a DDiT forward has not); on an MDLM without time conditioning {list(PLAIN_CANVAS)} run too")
    return ""


def runs_on(samplers: Iterable[Any], model: Any) -> list[str]:
    """The registered samplers written for `model`'s family that accept it (their own `check_model`)."""
    names = []
    for s in samplers:
        if mismatch(s, model):
            continue
        try:
            s.check_model(model)
        except SamplerConfigError:
            continue
        names.append(s.name)
    return names


def check_family(sampler: Any, model: Any, samplers: Iterable[Any]) -> None:
    """Refuse `sampler` on a model family it was not written for (before its settings read the model's config)."""
    why = mismatch(sampler, model)
    if not why:
        return
    allowed = runs_on(samplers, model)
    raise SamplerConfigError(f"sampler={sampler.name!r} cannot run this {model.cfg.family!r} model: {why}. Samplers "
                             f"for it: {allowed} (or sampler='auto').", argument="sampler", value=sampler.name,
                             allowed=", ".join(repr(n) for n in allowed) or "sampler='auto'")
