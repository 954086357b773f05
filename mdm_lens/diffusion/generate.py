"""`generate`: one entry point for every registered sampler (`mdm_lens.diffusion.registry`), with every setting
checked before compute.

    out = model.generate(prompt, steps=64, gen_length=64, block_length=32,       # LLaDA sampler
                         record=[ReceivedAttention()],
                         cache="blocks.0.attn.hook_pattern" @ steps(0, -1))
    out.records["received_attention"]     # [step, batch, layer, head, key]
    out.cache.stack("blocks.0.attn.hook_pattern")    # [2, batch, head, query, key]
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from torch import Tensor

from mdm_lens.diffusion import arm, diffusion_gemma, dream, llada, registry  # noqa: F401  (each registers itself)
from mdm_lens.diffusion import llada2, sdar  # noqa: F401  (block diffusion: LLaDA2.x, SDAR)
from mdm_lens.diffusion import fastdllm_v2  # noqa: F401  (block diffusion: Fast-dLLM v2)
from mdm_lens.diffusion import ddit  # noqa: F401  (MDLM, Duo)
from mdm_lens.diffusion import nemotron  # noqa: F401  (Nemotron-Labs-Diffusion: block diffusion + AR mode)
from mdm_lens.diffusion import coda, rnd1  # noqa: F401  (CoDA, RND1)
from mdm_lens.diffusion import dreamon, indel  # noqa: F401  (variable-length: DreamOn, LLaDA2.2 InDel)
from mdm_lens.diffusion import bd3lm, gidd  # noqa: F401  (BD3LM, GIDD)
from mdm_lens.diffusion.canvas import CanvasSampler, Plan
from mdm_lens.diffusion.memory_guard import guard
from mdm_lens.diffusion.observation_checks import check_observation as _check_observation
from mdm_lens.diffusion.output import GenerateOutput, weights_sample
from mdm_lens.diffusion.registry import Observation

SamplerName = str  # a registered sampler's name (`registry.names()`) or "auto"


def default_sampler(model: Any) -> str:
    if model.cfg.family == "diffusion_gemma":
        return "diffusion_gemma"
    if model.cfg.family == "llada2_moe":
        return "llada2"
    if model.cfg.family in ("sdar", "sdar_moe"):
        return "sdar"
    if model.cfg.family == "fastdllm_v2":
        return "fastdllm_v2"
    if model.cfg.family in ("mdlm", "duo", "bd3lm", "gidd"):
        return model.cfg.family
    if model.cfg.family == "nemotron_dllm":
        return "nemotron_ar" if model.cfg.attention == "causal" else "nemotron"
    if model.cfg.family in ("rnd1", "coda"):
        return model.cfg.family
    if model.cfg.attention == "causal":
        return "arm"
    return "dream" if model.cfg.logit_shift else "llada"


def generate(model: Any, prompt: Any, *, sampler: SamplerName = "auto", attention_mask: Tensor | None = None,
             fwd_hooks: Sequence[Any] = (), hook_steps: Any = None, record: Sequence[Any] = (), cache: Any = None,
             seed: int | None = 0, progress: bool | None = None, **settings: Any) -> GenerateOutput:
    """Run a sampler step by step with hooks, reducers and a trajectory cache.

    `settings` are the chosen sampler's own (its `Settings` dataclass in its module, with the reference
    defaults): e.g. `steps`, `gen_length`, `block_length`, `temperature`, `cfg_scale`, `remasking` for LLaDA
    (`mdm_lens.diffusion.llada.LLaDASettings`), `alg`, `eps`, `top_p`, `top_k` for Dream (`dream.DreamSettings`),
    `stop_at_eos` for the ARM (`arm.ARMSettings`), transformers' names for DiffusionGemma. `out.settings` lists
    every value the run used. A setting the sampler does not have is an error (another sampler's option at its
    do-nothing value, e.g. `cfg_scale=0` on Dream, is accepted), so nothing is silently ignored. Every argument
    is checked before any compute (typed errors of `mdm_lens.errors`).

    Args:
        prompt: text (needs a tokenizer) or token ids `[batch, pos]`, left-padded with `attention_mask` (a
            right-padded batch is refused: the canvas is appended after the prompt).
        sampler: a registered sampler (`mdm_lens.diffusion.registry.names()`: "llada", "dream", "arm",
            "diffusion_gemma", "llada2", "sdar", ...) or "auto" (the model family's own: "llada2" for LLaDA2.x,
            "sdar" for SDAR / SDAR-MoE, "rnd1" for RND1, "coda" for CoDA, "llada" for LLaDA and
            LLaDA-MoE).
        fwd_hooks: a list of TL `(name, fn)` pairs (names may be globs or filters) or `at_steps(fn, [...], name=...)`.
        hook_steps: the steps at which plain `fwd_hooks` fire (default every step), e.g. `[0, -1]` or `steps(every=4)`.
        record: a list of streaming reducers, e.g. `[ReceivedAttention(), KeyValueNorms()]`.
        cache: a `TrajectoryCache`, a `"name" @ steps(...)` request, or hook names (every step).
        seed: seeds the sampler's own randomness (Gumbel noise, random remasking, sampling). The default 0 makes
            every call reproducible, so repeated calls without `seed=` return the same sample (and
            `torch.manual_seed` does not change it); pass a different seed per sample, or `seed=None` to draw from
            torch's global generator as the references do.

    More steps than tokens runs as in the reference but warns (`IdleStepsWarning`), naming the idle steps.
    `out.replay(model, step, fwd_hooks=...)` re-runs one step's forward pass outside the loop with the same
    `model.state` and the same step-bound hooks.
    """
    name = default_sampler(model) if sampler == "auto" else _sampler_name(sampler)
    plugin = registry.get(name)
    resolved = plugin.settings(model, settings)  # an unknown setting first: the clearest error
    plugin.check_model(model)
    _check_observation(fwd_hooks, record, cache, seed, progress)
    guard(model, prompt, name, settings, record, cache, resolved)  # over a budget (max_memory, a GPU's free memory): refused
    obs = Observation(attention_mask=attention_mask, fwd_hooks=fwd_hooks, hook_steps=hook_steps, record=record,
                      cache=cache, seed=seed, progress=progress)
    out = plugin.generate(model, prompt, resolved, obs)
    out.model_id, out.model_weights = id(model), weights_sample(model)  # for check_model (another seed's model)
    return out


def plan(model: Any, *, sampler: SamplerName = "auto", **settings: Any) -> Plan | None:
    """The steps, blocks and phases a `generate` call with these settings will run (checked as `generate` checks
    them; observation arguments are ignored); None for a sampler whose length is not known in advance."""
    settings = {k: v for k, v in settings.items() if k not in OBSERVATION}
    plugin = registry.get(default_sampler(model) if sampler == "auto" else _sampler_name(sampler))
    resolved = plugin.settings(model, settings)
    plugin.check_model(model)
    return plugin.plan(resolved) if isinstance(plugin, CanvasSampler) else None


def _sampler_name(sampler: Any) -> str:
    """A registered sampler's name; the refusal lists "auto" (the default: the model's own sampler) too."""
    from mdm_lens.errors import SamplerConfigError
    from mdm_lens.validate import choice

    return choice(sampler, ("auto", *registry.names()), name="sampler", error=SamplerConfigError)


OBSERVATION = tuple(f.name for f in dataclasses.fields(Observation))
