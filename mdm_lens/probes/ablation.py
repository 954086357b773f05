"""Causal check of retrieval heads (spec §3.7, Wu et al.): knock out heads, and compare the answer accuracy
with the top-K heads masked against K random heads masked.  Re-exported by :mod:`retrieval`."""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass
from typing import Any, Iterator, Literal, Sequence

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from mdm_lens.diffusion.output import model_key
from mdm_lens.diffusion.rules import derived_steps
from mdm_lens.probes._checks import own_generate_keywords
from mdm_lens.diffusion.fixed_length import refuse_variable_sampler
from mdm_lens import validate
from mdm_lens.errors import ArgumentError, ArgumentTypeError, InputError, OutOfRangeError

from ._results import ResultMixin
from ._runtools import _batch, _nonempty, _optional_length
from ._retrieval_items import RetrievalScores, _as_item, answer_correct

__all__ = ["head_mask_hooks", "mask_heads", "answer_accuracy", "ablation_accuracy", "AblationResult"]


# ----------------------------------------------------------------------------------------------
# causal check: head masking and accuracy
# ----------------------------------------------------------------------------------------------

def _by_layer(heads: Sequence[tuple[int, int]]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for l, h in heads:
        out.setdefault(int(l), []).append(int(h))
    return out


def _heads(heads: Any, model: Any = None) -> list[tuple[int, int]]:
    """(layer, head) pairs; with a model, negatives count from the end and out-of-range raises."""
    if isinstance(heads, (str, bytes, Tensor)) or not isinstance(heads, Sequence):
        raise ArgumentTypeError(f"heads={validate.describe(heads)} is invalid: expected a list of (layer, head) pairs.",
                                argument="heads", value=heads, allowed="[(layer, head), ...]")
    out = []
    for i, pair in enumerate(heads):
        if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2:
            raise ArgumentTypeError(f"heads[{i}]={pair!r} is invalid: expected a (layer, head) pair.",
                                    argument=f"heads[{i}]", value=pair, allowed="(layer, head)")
        if model is None:
            l = validate.integer(pair[0], name=f"heads[{i}][0]", min=0, error=OutOfRangeError)
            h = validate.integer(pair[1], name=f"heads[{i}][1]", min=0, error=OutOfRangeError)
        else:
            l = validate.index(pair[0], model.cfg.n_layers, name=f"heads[{i}][0]", what="layer")
            h = validate.index(pair[1], model.cfg.n_heads, name=f"heads[{i}][1]", what="head")
        out.append((l, h))
    if len(set(out)) != len(out):
        raise ArgumentError(f"heads={heads!r} names a head twice.", argument="heads", value=heads,
                            allowed="distinct (layer, head) pairs")
    return out


def head_mask_hooks(heads: Sequence[tuple[int, int]], method: Literal["zero", "uniform"] = "zero",
                    model: Any = None) -> list[tuple[str, Any]]:
    """TL hooks that knock out heads (layer, head).

    ``zero``: z^{l,h} := 0 on ``blocks.{l}.attn.hook_z`` (the head writes nothing).  ``uniform``: the
    head's pre-softmax scores := 0 on every visible key (``hook_attn_scores``), i.e. uniform attention.
    With ``model``, layers / heads are checked against it (negatives count from the end); without,
    they must be non-negative.
    """
    method = validate.choice(method, ("zero", "uniform"), name="method")
    heads = _heads(heads, model)
    hooks = []
    for l, hs in _by_layer(heads).items():
        idx = torch.tensor(hs)
        if method == "zero":
            def fn(z: Tensor, hook: Any, idx=idx) -> Tensor:
                z = z.clone()
                z[:, :, idx.to(z.device)] = 0
                return z
            hooks.append((f"blocks.{l}.attn.hook_z", fn))
        else:
            def fn(s: Tensor, hook: Any, idx=idx) -> Tensor:
                s = s.clone()
                sub = s[:, idx.to(s.device)]
                s[:, idx.to(s.device)] = torch.where(torch.isfinite(sub), torch.zeros_like(sub), sub)
                return s
            hooks.append((f"blocks.{l}.attn.hook_attn_scores", fn))
    return hooks


@contextlib.contextmanager
def mask_heads(model: Any, heads: Sequence[tuple[int, int]], method: Literal["zero", "uniform"] = "zero"
               ) -> Iterator[Any]:
    """Context manager: the heads are knocked out (see :func:`head_mask_hooks`) for every forward inside,
    ``model.generate`` included; the hooks are removed on exit (TL ``hooks()`` context)."""
    with model.hooks(fwd_hooks=head_mask_hooks(heads, method, model=model)):
        yield model


@torch.no_grad()
def answer_accuracy(model: Any, items: Sequence[Any], fwd_hooks: Sequence[Any] = (), gen_length: int | None = None,
                    steps: int | None = None, seed: int = 0, decode: Any = None, **generate_kwargs: Any) -> float:
    """Mean :func:`answer_correct` of each item generated alone with ``fwd_hooks``."""
    own_generate_keywords(generate_kwargs, answer_accuracy)
    refuse_variable_sampler(generate_kwargs, 'answer_accuracy',
                            "the answer would be read at fixed positions after the prompt, where a variable-length run's span has moved")
    items = _nonempty(items, "items")
    g = _optional_length(gen_length, "gen_length") or int(model.cfg.extra.get("gen_length", 4))
    steps = _optional_length(steps, "steps")
    seed = validate.seed(seed)
    hits = []
    for raw in items:
        item = _as_item(raw, model)
        out = model.generate(_batch(item.prompt_ids, model.input_device), steps=derived_steps(steps, g), gen_length=g,
                             fwd_hooks=list(fwd_hooks), seed=seed, **generate_kwargs)
        hits.append(answer_correct(model, out.tokens[0, out.prompt_length:].cpu(), item.answer, decode))
    return float(np.mean(hits)) if hits else float("nan")


@dataclass
class AblationResult(ResultMixin):
    """Accuracy with no heads masked, the top-K heads masked, and K random heads masked (each draw).

    ``to_frame()`` columns: ``condition`` (``clean``, ``top``, ``random``), ``draw`` (random draw index),
    ``k``, ``accuracy`` (fraction of items answered correctly), ``heads`` (the masked (layer, head) list).
    """

    k: int
    method: str
    top_heads: list[tuple[int, int]]
    random_heads: list[list[tuple[int, int]]]
    accuracy_clean: float
    accuracy_top: float
    accuracy_random: list[float]

    @property
    def drop_top(self) -> float:
        return self.accuracy_clean - self.accuracy_top

    @property
    def drop_random(self) -> float:
        return self.accuracy_clean - float(np.mean(self.accuracy_random)) if self.accuracy_random else float("nan")

    def to_frame(self, lead_dims=None, metrics=None) -> pd.DataFrame:
        rows = [dict(condition="clean", draw=None, k=0, accuracy=self.accuracy_clean, heads=""),
                dict(condition="top", draw=None, k=self.k, accuracy=self.accuracy_top, heads=str(self.top_heads))]
        rows += [dict(condition="random", draw=i, k=self.k, accuracy=a, heads=str(h))
                 for i, (a, h) in enumerate(zip(self.accuracy_random, self.random_heads))]
        return pd.DataFrame(rows)


def ablation_accuracy(model: Any, items: Sequence[Any], heads: RetrievalScores | Sequence[tuple[int, int]], k: int,
                      control: Literal["random"] = "random", seed: int = 0, n_random: int = 3,
                      method: Literal["zero", "uniform"] = "zero", **kwargs: Any) -> AblationResult:
    """Causal check (Wu et al.; §3.7): accuracy after masking the top-``k`` heads vs ``k`` random heads.

    ``heads``: a :class:`RetrievalScores` (its ``top(k)``) or a ranked list of (layer, head).  Random
    heads are drawn (``seed``) among all heads outside the top-k, ``n_random`` times.  ``kwargs`` go to
    :func:`answer_accuracy`.
    """
    own_generate_keywords(kwargs, ablation_accuracy, also=[answer_accuracy])  # a misspelt method= names itself
    control = validate.choice(control, ("random",), name="control")
    method = validate.choice(method, ("zero", "uniform"), name="method")
    n_total = model.cfg.n_layers * model.cfg.n_heads
    k = validate.integer(k, name="k", min=1, max=n_total - 1)
    n_random = validate.integer(n_random, name="n_random", min=1)
    seed = validate.seed(seed)
    if isinstance(heads, RetrievalScores):
        if heads.model_key is not None and heads.model_key != model_key(model):  # another model's heads
            raise InputError(f"heads are the retrieval scores of {heads.model_key[0]!r} {heads.model_key[1:]}, not of "
                             f"the model given, {model.cfg.model_name!r}: score this model's heads first.",
                             argument="heads", value=heads.model_key[0], allowed="scores of this model")
        top = heads.top(min(k, heads.scores.numel()))
    else:
        top = _heads(heads, model)[:k]
    if len(top) < k:
        raise ArgumentError(f"heads ranks {len(top)} heads but k={k}: expected at least k ranked heads.",
                            argument="k", value=k, allowed=f"<= {len(top)}")
    pool = [(l, h) for l in range(model.cfg.n_layers) for h in range(model.cfg.n_heads) if (l, h) not in top]
    rng = random.Random(seed)
    draws = [rng.sample(pool, min(k, len(pool))) for _ in range(n_random)]
    acc = lambda hs: answer_accuracy(model, items, fwd_hooks=head_mask_hooks(hs, method), **kwargs)  # noqa: E731
    return AblationResult(k=k, method=method, top_heads=top, random_heads=draws,
                          accuracy_clean=answer_accuracy(model, items, **kwargs), accuracy_top=acc(top),
                          accuracy_random=[acc(d) for d in draws])
