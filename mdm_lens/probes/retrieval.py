"""Retrieval heads adapted to diffusion unmasking (spec §1.d, §3.7), Wu et al.'s original for ARMs,
and the causal check (mask the top-K heads against K random heads).

Copy-paste event for head (l, h) at answer position p with emitted token w_p: with
j* = argmax_j A^{s,l,h}_{q(p), j}, the event counts iff j* ∈ E (the needle / answer-bearing evidence
span) and x_{j*} = w_p.  q(p) is the readout row (p; p − 1 for ``logit_shift`` MDMs and for ARMs,
whose token at p is emitted by the query at p − 1).  Score per sample = |distinct copied needle
positions| / |needle|; samples count only if the answer is correct; final score = mean over counted
samples; a retrieval head has score > 0.1.  Methods (which step s supplies A):

- ``copy@commit`` (default): s = s(p), the step whose logits committed p;
- ``copy@any``: any step s ≤ s(p) (p still masked at the step's input);
- ``copy@final``: one clean forward on the final sequence (AF-like);
- ``wu``: ARMs only, greedy decoding, s = the decode step of p (≡ ``copy@commit`` for an ARM);
- ``evidence_focus`` (README-style, lax, *not* a retrieval score): the fraction of answer positions whose
  argmax key at the commit step lies in the gold document, with no token-identity check.

"Answer positions" are the generated positions whose final token is not EOS / pad / mask.  Argmax keys
come from ``TopKKeys(k=1)`` reducers (no T×T is stored).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Sequence

import pandas as pd
import torch
from torch import Tensor

from mdm_lens.diffusion.output import model_key
from mdm_lens.diffusion.rules import derived_steps
from mdm_lens.probes._checks import own_generate_keywords
from mdm_lens.diffusion.fixed_length import refuse_variable_sampler
from mdm_lens.hooks import TopKKeys
from mdm_lens.hooks.names import expand_names
from mdm_lens.hooks.record_steps import record_steps
from mdm_lens.hooks.steps import _Bound

from mdm_lens import validate
from mdm_lens.errors import ArgumentError, ArgumentTypeError, OutOfRangeError

from ._results import ResultMixin, to_numpy
from ._runtools import (_batch, _nonempty, _optional_length, is_block_diffusion, layer_list, readout_shift,
                        sequence_view, step_forward_kwargs)

__all__ = ["RetrievalItem", "from_qa_item", "retrieval_scores", "RetrievalScores", "METHODS", "answer_correct",
           "head_mask_hooks", "mask_heads", "answer_accuracy", "ablation_accuracy", "AblationResult"]

Method = Literal["copy@commit", "copy@any", "copy@final", "evidence_focus", "wu"]
METHODS: tuple[str, ...] = ("copy@commit", "copy@any", "copy@final", "evidence_focus", "wu")


from ._retrieval_items import RetrievalItem, RetrievalScores, _as_item, _decode, _span, answer_correct, from_qa_item  # noqa: E402,F401  (shared with ablation)


def _answer_positions(model: Any, tokens: Tensor, prompt_length: int) -> list[int]:
    skip = {model.cfg.eos_token_id, model.cfg.pad_token_id, model.cfg.mask_token_id} - {None}
    return [p for p in range(prompt_length, tokens.shape[0]) if int(tokens[p]) not in skip]


@torch.no_grad()
def _final_argmax(model: Any, tokens: Tensor, layers: list[int], fwd_hooks: Sequence[Any],
                  prompt_length: int, forward_kwargs: dict | None = None) -> Tensor:
    """argmax_j A^{l,h}_{i,j} of one clean forward: ``[layer, head, query]`` (block-diffusion models: the
    encoder over the prompt + the decoder over the answer, query rows at absolute positions)."""
    got: dict[int, Tensor] = {}
    if is_block_diffusion(model):
        hooks = [(n, fn) for name, fn in _plain(fwd_hooks) for n in expand_names(model, name)]
        view = sequence_view(model, tokens[None], None, layers, prompt_length, fwd_hooks=hooks)
        return torch.stack([view.cache[f"blocks.{l}.attn.hook_pattern"][0].argmax(-1).cpu() for l in layers])

    def make(l: int):
        def hook(pattern: Tensor, hook: Any) -> None:
            got[l] = pattern[0].argmax(-1).cpu()
        return hook

    hooks = [(n, fn) for name, fn in _plain(fwd_hooks) for n in expand_names(model, name)]
    hooks += [(f"blocks.{l}.attn.hook_pattern", make(l)) for l in layers]
    # a block run's final sequence under the run's block length (step_forward_kwargs), not the checkpoint default
    model.run_with_hooks(tokens[None], fwd_hooks=hooks, return_type=None, **(forward_kwargs or {}))
    return torch.stack([got[l] for l in layers])


def _plain(fwd_hooks: Sequence[Any]) -> list[tuple[Any, Any]]:
    """(name, fn) pairs usable outside ``generate`` (StepHook / at_steps bindings fire unconditionally)."""
    out = []
    for h in fwd_hooks:
        if isinstance(h, tuple):
            name, fn = h
            out.append((name, fn.fn if isinstance(fn, _Bound) else fn))
        else:  # StepHook
            out.append((h.name, h.fn))
    return out


def _keys_per_position(method: str, out: Any, positions: list[int], shift: int, layers: list[int],
                       model: Any, fwd_hooks: Sequence[Any]) -> list[Tensor]:
    """For each answer position p, the argmax keys ``[n_events, layer, head]`` of the readout row q(p)."""
    if method == "copy@final":
        am = _final_argmax(model, out.tokens[0], layers, fwd_hooks, out.prompt_length,
                           step_forward_kwargs(out))                                # [layer, head, query]
        return [am[:, :, p - shift][None] for p in positions]
    top = out.records["topk_keys"][:, 0, :, :, :, 0]                       # [step, layer, head, query]
    row_of = {s: i for i, s in enumerate(record_steps(out, "topk_keys", top.shape[0]))}
    cs = out.trajectory.commit_step[0]
    keys = []
    for p in positions:
        sp = int(cs[p])
        wanted = range(sp + 1) if method == "copy@any" else [sp]
        rows = [row_of[s] for s in wanted if s in row_of]
        keys.append(top[rows][:, :, :, p - shift] if rows else torch.empty(0, len(layers), top.shape[2], dtype=torch.long))
    return keys


def _sample_score(method: str, item: RetrievalItem, tokens: Tensor, positions: list[int],
                  keys: list[Tensor], n_layers: int, n_heads: int) -> Tensor:
    """copy methods: |distinct copied needle positions| / |needle|; evidence_focus: share of answer
    positions whose argmax key is in the gold doc."""
    T = tokens.shape[0]
    tok = tokens.cpu()
    if method == "evidence_focus":
        doc = item.doc_mask(T)
        hits = torch.zeros(n_layers, n_heads, dtype=torch.float64)
        for k in keys:
            valid = (k >= 0) & doc[k.clamp_min(0)]
            hits += valid.any(0).to(torch.float64)
        return hits / max(len(keys), 1)
    needle = item.needle_mask(T)
    copied = torch.zeros(n_layers, n_heads, T, dtype=torch.bool)
    for p, k in zip(positions, keys):
        kc = k.clamp_min(0)
        event = (k >= 0) & needle[kc] & (tok[kc] == tok[p])                # [n, layer, head]
        hot = torch.zeros(*k.shape, T, dtype=torch.bool).scatter_(-1, kc[..., None], event[..., None])
        copied |= hot.any(0)
    return copied.sum(-1).to(torch.float64) / max(int(needle.sum()), 1)


def _generate(model: Any, item: RetrievalItem, method: str, layers: list[int], gen_length: int, steps: int | None,
              fwd_hooks: Sequence[Any], seed: int, generate_kwargs: dict) -> Any:
    record = [] if method == "copy@final" else [TopKKeys(k=1, layers=layers)]
    kw = dict(generate_kwargs)
    if method == "wu":
        kw.update(sampler="arm", temperature=0.0)
    return model.generate(_batch(item.prompt_ids, model.input_device), steps=derived_steps(steps, gen_length), gen_length=gen_length,
                          record=record, fwd_hooks=list(fwd_hooks), seed=seed, **kw)


def retrieval_scores(model: Any, items: Sequence[Any], method: Method = "copy@commit", *,
                     layers: Sequence[int] | None = None, gen_length: int | None = None, steps: int | None = None,
                     threshold: float = 0.1, only_correct: bool = True, decode: Any = None,
                     fwd_hooks: Sequence[Any] = (), seed: int = 0, **generate_kwargs: Any) -> RetrievalScores:
    """Per-head retrieval scores over ``items`` (``RetrievalItem`` or zoo ``QAItem``), see the module doc.

    Each item is generated alone (``model.generate``, default sampler, ``gen_length`` defaults to
    ``cfg.extra["gen_length"]``); ``fwd_hooks`` are passed to the sampler (and to the final forward of
    ``copy@final``).  ``only_correct=False`` scores every sample.
    """
    own_generate_keywords(generate_kwargs, retrieval_scores)
    refuse_variable_sampler(generate_kwargs, 'retrieval_scores',
                            'a retrieval head would be scored on the key that held the copied token at its commit step, which has moved since')
    method = validate.choice(method, METHODS, name="method")
    from mdm_lens.probes._retrieval_items import check_decode

    check_decode(decode)
    if method == "wu" and model.cfg.attention != "causal":
        raise ArgumentError("method='wu' is Wu et al.'s autoregressive protocol; use copy@commit for an MDM.",
                            argument="method", value=method, allowed="copy@commit | copy@any | copy@final | "
                            "evidence_focus on an MDM")
    items = _nonempty(items, "items")
    ls = layer_list(model, layers)
    threshold = validate.number(threshold, name="threshold", min=0, max=1)
    only_correct = validate.boolean(only_correct, name="only_correct")
    seed = validate.seed(seed)
    steps = _optional_length(steps, "steps")
    g = _optional_length(gen_length, "gen_length") or int(model.cfg.extra.get("gen_length", 4))
    shift, H = readout_shift(model), model.cfg.n_heads
    per, correct, no_needle, wrong, no_position = [], [], 0, 0, 0
    for raw in items:
        item = _as_item(raw, model)
        out = _generate(model, item, method, ls, g, steps, fwd_hooks, seed, generate_kwargs)
        toks = out.tokens[0].cpu()
        ok = answer_correct(model, toks[out.prompt_length:], item.answer, decode)
        positions = _answer_positions(model, toks, out.prompt_length)
        correct.append(ok)
        # nothing to copy from (or attend to): the score is undefined, not 0 ("never copies")
        needle_less = (item.gold_doc is None) if method == "evidence_focus" else not item.evidence
        no_needle += int(needle_less)
        miss = only_correct and not ok
        if miss or not positions or needle_less:  # one reason per item, in this order (needle_less counted above)
            wrong += int(miss and not needle_less)
            no_position += int(not positions and not miss and not needle_less)
            per.append(torch.full((len(ls), H), torch.nan, dtype=torch.float64))
            continue
        keys = _keys_per_position(method, out, positions, shift, ls, model, fwd_hooks)
        per.append(_sample_score(method, item, toks, positions, keys, len(ls), H))
    per_t = torch.stack(per) if per else torch.empty(0, len(ls), H, dtype=torch.float64)
    counted = ~torch.isnan(per_t[:, 0, 0]) if len(per) else torch.zeros(0, dtype=torch.bool)
    scores = per_t[counted].mean(0) if bool(counted.any()) else torch.full((len(ls), H), torch.nan, dtype=torch.float64)
    above = [(ls[i], h) for i, h in (scores > threshold).nonzero().tolist()]
    above.sort(key=lambda lh: -float(scores[ls.index(lh[0]), lh[1]]))
    notes = ["evidence_focus is a lax attention-to-gold-doc share, not a retrieval score"] if method == "evidence_focus" else []
    if no_needle:
        what = "gold document" if method == "evidence_focus" else "needle (evidence span)"
        notes.append(f"{no_needle} of {len(per)} item(s) have no {what}: not scored (NaN), not counted")
    if wrong:
        notes.append(f"{wrong} of {len(per)} item(s) were answered wrongly: not counted (only_correct=True)")
    if no_position:
        notes.append(f"{no_position} of {len(per)} item(s) have no answer position: not counted")
    if not bool(counted.any()):  # every score NaN: say why, here and in a warning
        notes.append("no item was counted, so every head's score is NaN (undefined, not 0)")
        warnings.warn("retrieval_scores: " + "; ".join(notes), UserWarning, stacklevel=2)
    return RetrievalScores(method=method, threshold=threshold, layers=ls, scores=scores, per_sample=per_t,
                           correct=torch.tensor(correct, dtype=torch.bool), n_counted=int(counted.sum()),
                           above_threshold=above, retrieval_heads=[] if method == "evidence_focus" else above,
                           notes=notes, model_key=model_key(model))


# The causal check (head masking, accuracy with the top-K vs K random heads masked) lives in ablation.py;
# re-exported here, its historical home.
from .ablation import (AblationResult, ablation_accuracy, answer_accuracy, head_mask_hooks,  # noqa: E402
                       mask_heads)
