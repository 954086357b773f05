"""Which items each probe can use, checked before anything runs (nothing is scored on an item a probe cannot use).

Two stages: :func:`data_problems` needs only the parsed line (no answers for ``accuracy``, a closed-book item for
``retrieval``, ...); :func:`render_problems` needs the model and the rendered prompt (too long for the context,
a gold passage past ``max_passages``, no needle for ``retrieval``, a gold answer the tokenizer can only spell
with its unknown token, an answer longer than knockout's canvas). The runner raises on the first problem, or,
with ``--skip-bad``, skips the item and records every reason (``skipped.parquet`` and the manifest).

:func:`render_warnings` lists what is worth knowing but leaves the item usable (non-gold passages not shown).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from mdm_lens import tokenization
from mdm_lens.errors import InputError, SamplerConfigError
from mdm_lens.tokenization import unknown_token_ids  # noqa: F401  (re-exported)
from mdm_lens.sweep import templates as TM
from mdm_lens.sweep.items import SweepItem
from mdm_lens.sweep.templates import Rendered

__all__ = ["data_problems", "render_problems", "render_warnings", "unknown_token_ids", "ANSWER_PROBES", "Selection",
           "screen", "select", "check_sampler"]

#: Probes that score the gold answer's text or tokens.
ANSWER_PROBES = ("accuracy", "retrieval", "knockout")


def data_problems(item: SweepItem, probes: Sequence[str]) -> list[str]:
    """Reasons (one per probe and cause) why ``probes`` cannot use ``item``, from its parsed fields alone."""
    out = []
    if "accuracy" in probes:
        if not item.is_qa:
            out.append("probe 'accuracy' needs a question (a plain prompt has no closed-book variant)")
        elif not item.answers:
            out.append("probe 'accuracy' needs answers; the item has none")
    if "retrieval" in probes:
        if not item.is_qa or not item.passages:
            out.append("probe 'retrieval' needs a question with passages; the item is "
                       + ("a plain prompt" if not item.is_qa else "closed-book (no passages)"))
        else:
            if not item.answers:
                out.append("probe 'retrieval' needs answers; the item has none")
            if not item.gold_indices:
                out.append("probe 'retrieval' needs a gold passage; the item marks none")
    if "flow" in probes and (not item.is_qa or not item.passages):
        out.append("probe 'flow' needs a question with passages; the item is "
                   + ("a plain prompt" if not item.is_qa else "closed-book (no passages)"))
    return out


def render_problems(model: Any, r: Rendered, probes: Sequence[str], gen_length: int, unk: set[int]) -> list[str]:
    """Reasons why ``probes`` cannot use the rendered item ``r`` (``unk``: :func:`unknown_token_ids`)."""
    item, out = r.item, []
    if len(r.ids) + gen_length > model.cfg.n_ctx:
        out.append(f"{len(r.ids)} prompt tokens + gen_length {gen_length} exceed the model's context of "
                   f"{model.cfg.n_ctx}")
    lost = [g for g in item.gold_indices if g in r.dropped]
    if lost and item.passages:
        out.append(f"gold passage(s) {[g + 1 for g in lost]} of {len(item.passages)} are past max_passages="
                   f"{len(item.passages) - len(r.dropped)} and would not be shown (raise --max-passages)")
    if "retrieval" in probes and r.qa is not None and item.gold_indices and not lost and r.qa.evidence_span is None:
        out.append("probe 'retrieval' needs the gold answer inside a gold passage (its needle); no answer occurs "
                   "there as a whole word")
    if any(p in probes for p in ANSWER_PROBES) and item.answers:
        tok = tokenization.require(model.tokenizer)
        for a in item.answers:
            ids = tokenization.encode(tok, a)
            if unk & set(ids):
                out.append(f"gold answer {a!r} tokenizes to the unknown token (id {sorted(unk & set(ids))[0]}): it "
                           "would be scored as that token")
        if "knockout" in probes:
            n = len(tokenization.encode(tok, item.answers[0]))
            if n > gen_length:
                out.append(f"probe 'knockout' places the gold answer in the canvas, but {item.answers[0]!r} is {n} "
                           f"tokens > gen_length {gen_length}")
    return out


#: Above this share of unknown-token prompt ids a rendered prompt is flagged: the model then reads mostly one
#: placeholder token (e.g. a template's instruction words outside a tiny vocabulary), and its results say little.
UNKNOWN_SHARE_WARN = 0.2


def render_warnings(r: Rendered, unk: set[int] | frozenset[int] = frozenset()) -> list[str]:
    """What a reader of the tables should know about ``r`` that does not make it unusable (``unk``:
    :func:`unknown_token_ids`; a prompt whose ids are more than ``UNKNOWN_SHARE_WARN`` unknown tokens is flagged)."""
    out = []
    shown = len(r.item.passages) - len(r.dropped)
    if r.dropped:
        out.append(f"passages {r.dropped[0] + 1}..{r.dropped[-1] + 1} of {len(r.item.passages)} not shown "
                   f"(max_passages={shown})")
    n_unk = sum(i in unk for i in r.ids)
    if r.ids and n_unk / len(r.ids) > UNKNOWN_SHARE_WARN:
        out.append(f"{n_unk} of the prompt's {len(r.ids)} tokens ({n_unk / len(r.ids):.0%}) are the tokenizer's "
                   f"unknown token (over {UNKNOWN_SHARE_WARN:.0%}): the template's or item's words are outside the "
                   "model's vocabulary, so the model "
                   "reads mostly a placeholder (the zoo template uses the twins' vocabulary)")
    return out


@dataclass
class Selection:
    """The items a sweep runs (data order), their rendered prompts, and what was left out or is worth knowing."""

    items: list[SweepItem]
    rendered: list[Rendered] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)     # {item_id, line, reason}
    warnings: list[dict[str, Any]] = field(default_factory=list)    # {item_id, line, warning}


def _refuse(path: str, item: SweepItem, reasons: list[str]) -> InputError:
    return InputError(f"{path}:{item.line}: item {item.id!r}: {reasons[0]} (drop the probe, fix the data, or use "
                      "--skip-bad to skip such items)", argument="data", value=path)


def screen(items: list[SweepItem], probes: Sequence[str], path: str, skip_bad: bool, limit: int | None) -> Selection:
    """Before the model loads: the items whose parsed fields suit every probe. Without ``skip_bad`` the first of
    the first ``limit`` items that does not suit raises; with it, such items are skipped with their reasons."""
    sel = Selection(items=[])
    for it in items:
        if not skip_bad and limit is not None and len(sel.items) >= limit:
            break
        reasons = data_problems(it, probes)
        if reasons and not skip_bad:
            raise _refuse(path, it, reasons)
        if reasons:
            sel.skipped.append(dict(item_id=it.id, line=it.line, reason="; ".join(reasons)))
        else:
            sel.items.append(it)
    return sel


def select(model: Any, screened: Selection, probes: Sequence[str], template: str, gen_length: int,
           max_passages: int, path: str, skip_bad: bool, limit: int | None) -> Selection:
    """The first ``limit`` usable items (all without a limit), rendered once; an item a probe cannot use raises,
    or with ``skip_bad`` is skipped and recorded. Items past the limit are not rendered."""
    unk = unknown_token_ids(model.tokenizer) if model.tokenizer is not None else set()
    sel = Selection(items=[], skipped=list(screened.skipped))
    for it in screened.items:
        if limit is not None and len(sel.items) >= limit:
            break
        r = TM.render(model, it, template, max_passages=max_passages)
        reasons = render_problems(model, r, probes, gen_length, unk)
        if reasons and not skip_bad:
            raise _refuse(path, it, reasons)
        if reasons:
            sel.skipped.append(dict(item_id=it.id, line=it.line, reason="; ".join(reasons)))
            continue
        sel.items.append(it)
        sel.rendered.append(r)
        sel.warnings += [dict(item_id=it.id, line=it.line, warning=w) for w in render_warnings(r, unk)]
    sel.skipped.sort(key=lambda d: d["line"])
    return sel


def check_sampler(model: Any, gen_kwargs: dict[str, Any]) -> None:
    """The sampler settings the sweep will pass (``adapter._gen_kwargs``), checked before anything is written
    (e.g. a ``block_length`` that does not divide ``gen_length``), as ``generate`` checks them."""
    from mdm_lens.diffusion.generate import default_sampler, plan

    name = default_sampler(model)
    if name == "diffusion_gemma":     # transformers' own settings; checked by its first call
        return
    try:
        plan(model, **gen_kwargs)  # the sampler plug-in's own resolution, exactly as generate runs it
    except SamplerConfigError as e:
        raise _as_sweep_error(e, name, gen_kwargs) from None


# the sweep's length arguments under the names samplers give them (registry.own_lengths)
SWEEP_NAMES = {"gen_length": "gen_length", "max_new_tokens": "gen_length", "steps": "steps", "n_steps": "steps",
               "block_length": "block_length", "block_size": "block_length"}


def _as_sweep_error(e: SamplerConfigError, sampler: str, gen_kwargs: dict[str, Any]) -> SamplerConfigError:
    """A conflict with a setting the sweep cannot pass (Fast-dLLM v2's `small_block_size`, kept at its default)
    names the sweep's own arguments: generate's advice to pass that setting has no sweep option to follow."""
    if e.argument in SWEEP_NAMES or e.argument is None:
        return e
    passed = {SWEEP_NAMES[k]: v for k, v in gen_kwargs.items() if k in SWEEP_NAMES and v is not None}
    blame = "block_length" if "block_length" in passed else "gen_length"
    what = str(e).split(" You did not pass")[0]
    return SamplerConfigError(
        f"the sweep passes only its lengths ({', '.join(f'{k}={v}' for k, v in passed.items())}) to sampler "
        f"{sampler!r} and keeps {e.argument} at its default, which they conflict with: {what} Choose "
        f"{blame} (--{blame.replace('_', '-')}) so that {e.argument}={e.value!r} is valid, or run the probes from "
        f"Python with generate's {e.argument}=.", argument=blame, value=passed.get(blame),
        allowed=f"a {blame} under which {e.argument}={e.value!r} is valid")


# probes a sampler's runs cannot give, and why: refused before anything is written, the other probes run
UNSUPPORTED = {
    "fastdllm_v2": {
        "retrieval": "its scores read TopKKeys over a steps grid, and Fast-dLLM v2 decides its number of forwards "
                     "itself (no steps setting) and computes one block's rows against an exact block KV cache",
        "flow": "its regions are laid out over gen_length answer tokens, and a Fast-dLLM v2 run stops at its stop "
                "token (and floors max_new_tokens to whole blocks), so the final canvas is not that layout",
        "atp": "attribution patching needs fresh forwards of each step's canvas, and every Fast-dLLM v2 forward reads "
               "the block KV cache of the finished blocks",
    },
}


def check_probes(model: Any, probes: Sequence[str]) -> None:
    """Refuse, before anything is written, the probes the model's default sampler cannot give (`UNSUPPORTED`),
    naming each with its reason and the probes that do run."""
    from mdm_lens.diffusion.generate import default_sampler

    name = default_sampler(model)
    bad = {p: why for p, why in UNSUPPORTED.get(name, {}).items() if p in probes}
    if bad:
        reasons = "; ".join(f"{p}: {why}" for p, why in bad.items())
        ok = [p for p in probes if p not in bad]
        raise SamplerConfigError(f"probes {sorted(bad)} cannot run on sampler {name!r} ({reasons}). Leave them out"
                                 + (f" (the others, {ok}, run)." if ok else "."),
                                 argument="probes", value=sorted(bad),
                                 allowed=f"probes other than {sorted(UNSUPPORTED[name])} for sampler {name!r}")
