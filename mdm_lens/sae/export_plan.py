"""The arguments of `export_activations` (`mdm_lens.sae.export`), checked before any generation: the data
(a jsonl read and rendered as the sweep does, text prompts or token ids), the hooks (each must give
`[batch, pos, ...]` activations; heads are flattened, as SAELens does), the steps and the sampler settings
(resolved by `generate`'s own `mdm_lens.diffusion.arguments`)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from mdm_lens import validate
from mdm_lens.diffusion import registry
from mdm_lens.errors import ArgumentError, ArgumentTypeError, InputError, SamplerConfigError
from mdm_lens.hooks.names import expand_names
from mdm_lens.hooks.steps import Steps
from mdm_lens.sweep import manifest as SM
from mdm_lens.sweep import templates as TM
from mdm_lens.sweep.items import read_items

__all__ = ["parse_steps", "SAMPLER_KEYS", "Prompt", "Source", "Plan", "read_data", "check_hooks_arg",
           "check_sampler_kwargs", "check_model", "hook_widths", "make_plan", "render_prompts", "data_hash"]

# the sampler settings `sampler_kwargs` may hold: every registered sampler's, less the ones with their own argument
# (the model's own sampler then refuses those it does not have, as generate does)
SAMPLER_KEYS = tuple(sorted(registry.all_settings() - {"steps", "gen_length", "block_length"}))


@dataclass(frozen=True)
class Prompt:
    item_id: str
    ids: tuple[int, ...]


@dataclass(frozen=True)
class Source:
    kind: str                 # "jsonl", "text" or "ids"
    items: list[Any]          # SweepItems, texts, or id lists
    path: str | None = None
    skipped: tuple = ()


@dataclass(frozen=True)
class Plan:
    hooks: dict[str, int]     # hook name -> d_in (heads flattened, as SAELens does)
    when: Steps
    gen_kwargs: dict[str, Any]
    settings: dict[str, Any]


# --- arguments -----------------------------------------------------------------------------------------
def parse_steps(text: str | None) -> Steps | None:
    """The command line's ``--steps`` as `steps(...)`: ``"0,-1"``, ``"first,last"``, ``"every=4"`` (steps 0, 4,
    8, ... and the last), or None / ``"all"`` for every step. Indices with ``every=`` keep the steps that
    satisfy both, as `steps(0, 8, every=4)` does."""
    from mdm_lens.hooks.steps import steps as make_steps

    if text is None or text == "all":
        return None
    if not isinstance(text, str) or not text.strip():
        raise ArgumentTypeError(f"steps={validate.describe(text)} must be a text such as '0,-1' or 'every=4'.",
                                argument="steps", value=text, allowed="'all', '0,-1', 'first,last', 'every=4'")
    indices: list[Any] = []
    every = None
    for part in (p.strip() for p in text.split(",")):
        if part.startswith("every="):
            every = part[len("every="):]
            if not every.isdigit():
                raise SamplerConfigError(f"steps={text!r}: every= takes a positive integer.", argument="steps",
                                         value=text, allowed="every=K with K >= 1")
            every = int(every)
        elif part in ("first", "last"):
            indices.append(part)
        elif part.lstrip("-").isdigit():
            indices.append(int(part))
        else:
            raise SamplerConfigError(f"steps={text!r}: {part!r} is not a step.", argument="steps", value=text,
                                     allowed="ints (negative from the end), 'first', 'last', 'every=K'")
    return make_steps(*indices, every=every)


def read_data(data: Any, skip_bad: bool, limit: int | None) -> Source:
    if isinstance(data, (str, Path)):
        read = read_items(data, skip_bad=skip_bad)
        items = read.items[:limit] if limit else read.items
        if not items:
            raise InputError(f"{data}: no usable items.", argument="data", value=str(data), allowed="a jsonl with items")
        return Source("jsonl", items, str(data), tuple(read.skipped))
    if isinstance(data, (list, tuple)) and not data:
        raise InputError(f"data={validate.describe(data)} is empty: expected at least one prompt.", argument="data",
                         value=data, allowed="a non-empty list of text prompts or token ids, or a jsonl path")
    if isinstance(data, Tensor):
        data = validate.tensor(data, name="data", ndim=(1, 2), dtype="int")
        rows = [data.tolist()] if data.ndim == 1 else data.tolist()
        kind = "ids"
    elif isinstance(data, (list, tuple)) and data and all(isinstance(d, str) for d in data):
        rows, kind = list(data), "text"
    elif isinstance(data, (list, tuple)) and data and all(isinstance(d, (list, tuple, Tensor)) for d in data):
        rows, kind = [], "ids"
        for i, r in enumerate(data):
            r = validate.tensor(torch.as_tensor(r) if not isinstance(r, Tensor) else r, name=f"data[{i}]", ndim=1,
                                dtype="int")
            rows.append(r.tolist())
    else:
        raise ArgumentTypeError(f"data={validate.describe(data)}: expected a jsonl path, a list of text prompts or "
                                "token ids.", argument="data", value=data,
                                allowed="str/Path (jsonl), list[str], list[list[int]] or an int tensor [batch, pos]")
    rows = rows[:limit] if limit else rows
    if kind == "text" and not all(rows):
        raise InputError("data holds an empty prompt.", argument="data", value=data, allowed="non-empty texts")
    return Source(kind, rows)


def check_hooks_arg(hooks: Any) -> Any:
    ok = isinstance(hooks, str) or (isinstance(hooks, (list, tuple)) and hooks and all(isinstance(h, str)
                                                                                       for h in hooks))
    if not ok:
        raise ArgumentTypeError(f"hooks={validate.describe(hooks)} must be a hook name, a glob or a non-empty list of "
                                "them.", argument="hooks", value=hooks, allowed="str or list of str")
    return hooks


def check_sampler_kwargs(kw: Any) -> dict[str, Any]:
    if kw is None:
        return {}
    if not isinstance(kw, dict):
        raise ArgumentTypeError(f"sampler_kwargs={validate.describe(kw)} must be a dict.", argument="sampler_kwargs",
                                value=kw, allowed=f"a dict with keys from {SAMPLER_KEYS}")
    own = {"steps": "n_steps", "gen_length": "gen_length", "block_length": "block_length"}
    for k in kw:
        if k in own:  # the export's own arguments (under LLaDA's names; Fast-dLLM v2's are mapped to them)
            raise ArgumentError(f"sampler_kwargs[{k!r}]: the export takes this length as its own argument; pass "
                                f"export_activations({own[k]}=...) instead.", argument="sampler_kwargs", value=k,
                                allowed=f"{own[k]}= (not in sampler_kwargs)")
        validate.choice(k, SAMPLER_KEYS, name="sampler_kwargs", error=SamplerConfigError)
    return dict(kw)


def check_model(model: Any) -> None:
    cfg = getattr(model, "cfg", None)
    if cfg is None or not hasattr(model, "generate"):
        raise ArgumentTypeError(f"model={validate.describe(model)} is not a HookedMDM.", argument="model", value=model,
                                allowed="a HookedMDM or a hub id / folder")
    # a uniform-state model (Duo) has no mask id: its "masked" positions are the generated ones (mdm_lens.noisy)
    no_mask = cfg.mask_token_id is None and not cfg.extra.get("uniform_state")
    if cfg.attention == "causal" or cfg.family == "diffusion_gemma" or no_mask:
        raise InputError(f"{cfg.model_name}: export_activations needs a masked diffusion model sampled by LLaDA's or "
                         "Dream's sampler (a causal model has no masked positions; DiffusionGemma re-decides its "
                         "canvas every step).", argument="model", value=cfg.model_name,
                         allowed="a bidirectional MDM with a mask token")


def hook_widths(model: Any, names: list[str]) -> dict[str, int]:
    """d_in per hook from one forward of a short masked canvas: the activation must be `[batch, pos, ...]`
    (an attention pattern, `[batch, head, query, key]`, has no per-position row and is refused)."""
    n = min(model.cfg.n_ctx, model.cfg.n_heads + 2)  # a length no head count can equal
    fill = 0 if model.cfg.mask_token_id is None else model.cfg.mask_token_id  # a uniform-state model: any id
    toks = torch.full((1, n), fill, dtype=torch.long, device=model.input_device)
    if model.cfg.bos_token_id is not None:
        toks[0, 0] = model.cfg.bos_token_id
    _, cache = model.run_with_cache(toks, names_filter=names, return_type=None)
    widths = {}
    for name in names:
        shape = tuple(cache[name].shape)
        if len(shape) not in (3, 4) or shape[:2] != (1, n):
            raise InputError(f"hook {name!r} gives activations of shape {shape} on a [1, {n}] input, not "
                             "[batch, pos, ...]: only per-position activations can be exported.", argument="hooks",
                             value=name, allowed="hook points shaped [batch, pos, d] or [batch, pos, head, d_head]")
        widths[name] = int(np.prod(shape[2:]))
    return widths


def make_plan(model: Any, hooks: Any, when: Steps, n_steps: int | None, gen_length: int | None,
              block_length: int | None, sampler_kwargs: dict[str, Any]) -> Plan:
    from mdm_lens.diffusion.canvas import CanvasSampler
    from mdm_lens.diffusion.generate import default_sampler

    sampler = default_sampler(model)
    plugin = registry.get(sampler)
    given, lengths = dict(sampler_kwargs), {}
    for name, value in (("n_steps", n_steps), ("gen_length", gen_length), ("block_length", block_length)):
        for key, own in _lengths(plugin, **{name: value}).items():
            lengths[key] = name
            if key in given and given[key] != own:  # two spellings of one setting: neither may win silently
                raise ArgumentError(f"{name}={own!r} and sampler_kwargs[{key!r}]={given[key]!r} set the same "
                                    f"setting of sampler {sampler!r} to different values; give one of them.",
                                    argument=name, value=own, allowed=f"unset, or {given[key]!r}")
            given[key] = own
    try:
        resolved = plugin.settings(model, given)  # the sampler's own checks, as generate runs them
    except SamplerConfigError as e:  # "pass stop_token=": here a sampler setting goes in sampler_kwargs
        if e.argument not in SAMPLER_KEYS or e.argument in lengths:
            raise
        raise SamplerConfigError(f"{e} (export_activations takes the sampler's settings in sampler_kwargs: "
                                 f"sampler_kwargs={{{e.argument!r}: ...}}.)", argument=e.argument, value=e.value,
                                 allowed=e.allowed) from None
    plugin.check_model(model)
    if not isinstance(plugin, CanvasSampler):
        raise SamplerConfigError(f"the export runs canvas samplers (LLaDA, Dream and their kin); {sampler!r} is not "
                                 "one.", argument="model", value=sampler, allowed="a canvas sampler's model")
    planned = plugin.plan(resolved)
    if tuple(when.phases) != ("cond",):
        raise SamplerConfigError(f"steps(phases={when.phases}): the export reads the sampler's 'cond' forward only.",
                                 argument="steps", value=when.phases, allowed="steps(...) with phases=('cond',)")
    when.check(planned.n_steps, planned.n_blocks, ("cond",), what="steps")
    names = expand_names(model, hooks)
    kw = dict(given)  # generate resolves the same defaults (the plan above checked them)
    settings = dict(sampler=sampler, **resolved.as_dict())
    settings.setdefault("gen_length", settings.get("max_new_tokens"))  # Fast-dLLM v2's name for it
    return Plan(hook_widths(model, names), when, kw, settings)


def _lengths(plugin: Any, **lengths: Any) -> dict[str, Any]:
    """The export's `n_steps` / `gen_length` / `block_length` under the sampler's own names
    (`registry.own_lengths`, shared with the sweep); unset ones are left to the sampler's defaults."""
    return registry.own_lengths(plugin, **lengths)


def render_prompts(model: Any, src: Source, template: str, gen_length: int) -> tuple[list[Prompt], str]:
    tmpl = ""
    if src.kind == "jsonl":
        tmpl = TM.resolve_template(model, template)
        out = [Prompt(it.id, tuple(TM.render(model, it, tmpl).ids)) for it in src.items]
    elif src.kind == "text":
        if model.tokenizer is None:
            raise InputError("text prompts need a tokenizer; this model has none: pass token ids.", argument="data",
                             value=src.items[0], allowed="token ids")
        out = [Prompt(str(i), tuple(model.to_tokens(t)[0].tolist())) for i, t in enumerate(src.items)]
    else:
        out = [Prompt(str(i), tuple(int(t) for t in r)) for i, r in enumerate(src.items)]
    d_vocab, mask = model.cfg.d_vocab, model.cfg.mask_token_id
    for p in out:
        if not p.ids:
            raise InputError(f"item {p.item_id!r} has no token.", argument="data", value=p.item_id,
                             allowed="at least one token per prompt")
        bad = [t for t in p.ids if not 0 <= t < d_vocab or t == mask]
        if bad:
            raise InputError(f"item {p.item_id!r}: token id {bad[0]} is out of range or the mask token {mask}.",
                             argument="data", value=bad[0], allowed=f"ids in [0, {d_vocab}) other than {mask}")
        if len(p.ids) + gen_length > model.cfg.n_ctx:
            raise InputError(f"item {p.item_id!r}: {len(p.ids)} prompt tokens + gen_length {gen_length} exceed the "
                             f"model's context of {model.cfg.n_ctx}.", argument="data", value=p.item_id,
                             allowed=f"prompts of at most {model.cfg.n_ctx - gen_length} tokens")
    return out, tmpl


def data_hash(src: Source, prompts: list[Prompt]) -> str:
    if src.kind == "jsonl":
        return SM.file_hash(src.path)
    blob = json.dumps([[p.item_id, list(p.ids)] for p in prompts]).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
