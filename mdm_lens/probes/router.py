"""Where mixture-of-experts layers send each token, step by step, and whether floating anchors route differently.

    out = model.generate(prompt, gen_length=32, steps=32)           # LLaDA-MoE, LLaDA2.x, SDAR-MoE
    stats = probes.router_stats(model, out, steps=[0, 8, -1])
    stats.table          # step, layer, class, expert, metric, value, reason (tidy)

Each chosen step's forward is replayed (`out.replay`: the step's own canvas and state; KV-cached runs are refused,
their forwards cannot be replayed) with the router and attention hooks of every MoE layer. Per step and layer:

* `router_entropy` (class "all"): the mean over visible positions of the entropy (nats) of the routing distribution
  — the router's softmax (LLaDA-MoE, SDAR-MoE), or the sigmoid scores normalised to sum 1 (LLaDA2);
* `positions` (per class): how many positions the class has at that step and layer;
* `load` (per class and expert): the share of that class's top-k slots that go to the expert; classes are
  "prompt", "canvas" (positions after the prompt), "anchor" and "non_anchor" (visible keys of that layer that are,
  or are not, floating anchors of the step: `detect_anchors`, z-score rule, on the attention each key receives,
  averaged over heads and visible query rows);
* `anchor_vs_rest_tv` (class "anchor"): total-variation distance between the anchor and non-anchor loads — 0 when
  anchors use experts exactly as the other tokens do, 1 when they share none. NaN with a reason when the step has
  no anchor (or nothing but anchors).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import pandas as pd
import torch
from torch import Tensor

from mdm_lens import validate
from mdm_lens.errors import InputError
from mdm_lens.probes.floating import detect_anchors

CLASSES = ("prompt", "canvas", "anchor", "non_anchor")


@dataclass
class RouterStats:
    """`.table` / `.to_frame()`: the tidy table (one row per measurement)."""

    table: pd.DataFrame  # step, layer, class, expert, metric, value, reason

    def loads(self, step: int, layer: int) -> pd.DataFrame:
        """[class × expert] load shares of one step and layer (a class with no position: a row of NaN)."""
        t = self.table
        rows = t[(t["metric"] == "load") & (t["step"] == step) & (t["layer"] == layer)]
        shares = rows[rows["expert"].notna()].pivot(index="class", columns="expert", values="value")
        return shares.reindex(index=list(CLASSES))

    def to_frame(self) -> pd.DataFrame:
        return self.table.copy()


def _moe_layers(model: Any) -> list[int]:
    return [i for i, b in enumerate(model.blocks) if hasattr(b.mlp, "hook_router_logits")]


def _route_distribution(mlp: Any, logits: Tensor) -> Tensor:
    if getattr(mlp, "score", "softmax") == "sigmoid":
        scores = torch.sigmoid(logits.double())
        return scores / scores.sum(-1, keepdim=True)
    return torch.softmax(logits.double(), dim=-1)


def _load(index: Tensor, where: Tensor, n_experts: int) -> Tensor | None:
    """Share of the top-k slots of the positions in `where` [batch, pos] per expert (None: no position)."""
    chosen = index[where]  # [n, top_k]
    if chosen.numel() == 0:
        return None
    counts = torch.bincount(chosen.flatten(), minlength=n_experts).double()
    return counts / counts.sum()


def router_stats(model: Any, out: Any, *, steps: Sequence[int] | None = None, layers: Sequence[int] | None = None,
                 fwd_hooks: Sequence[Any] = ()) -> RouterStats:
    """Routing statistics of `out`'s steps (default every step) at the MoE layers (default all of them);
    `fwd_hooks` are added to each replayed forward (e.g. those the run used, or an intervention to study)."""
    moe = _moe_layers(model)
    if not moe:
        raise InputError(f"{model.cfg.model_name} has no mixture-of-experts layer (no mlp.hook_router_logits).",
                         argument="model", value=model.cfg.model_name, allowed="a MoE model")
    n = model.cfg.n_layers
    chosen = moe if layers is None else validate.indices(layers, n, name="layers", what=f"layer of {n}")
    dense = [l for l in chosen if l not in moe]
    if dense:
        raise InputError(f"layers {dense} are dense (no router); the MoE layers are {moe}.", argument="layers",
                         value=list(layers or []), allowed=f"a subset of {moe}")
    n_steps = out.trajectory.n_steps
    step_list = list(range(n_steps)) if steps is None else validate.indices(
        steps, n_steps, name="steps", what=f"step of a run of {n_steps}")
    rows: list[dict[str, Any]] = []
    for step in step_list:
        got: dict[str, Tensor] = {}

        def keep(t: Tensor, hook: Any) -> None:
            got[hook.name] = t.detach()

        names = [f"blocks.{l}.{h}" for l in chosen for h in ("mlp.hook_router_logits", "mlp.hook_expert_indices",
                                                              "attn.hook_pattern")]
        with torch.no_grad():
            out.replay(model, step, fwd_hooks=list(fwd_hooks) + [(nm, keep) for nm in names])
        state = out.state_at(step)
        # a block run's replay covers the canvas up to its step's block end (`out.replay`): its positions only
        visible = state.key_visible[:, :got[names[0]].shape[1]].to(got[names[0]].device)
        # the step's own prompt rows: a variable-length run's prompt (DreamOn: prefix and suffix) follows its slots
        prompt = state.prompt[:, :visible.shape[1]].to(visible.device) & torch.ones_like(visible)
        for l in chosen:
            rows.extend(_layer_rows(model.blocks[l].mlp, step, l, got, visible, prompt))
    table = pd.DataFrame(rows, columns=["step", "layer", "class", "expert", "metric", "value", "reason"])
    for col in ("step", "layer", "expert"):
        table[col] = table[col].astype("Int64")
    return RouterStats(table)


def _layer_rows(mlp: Any, step: int, l: int, got: dict, visible: Tensor, prompt: Tensor) -> list[dict]:
    logits = got[f"blocks.{l}.mlp.hook_router_logits"]
    index = got[f"blocks.{l}.mlp.hook_expert_indices"]
    pattern = got[f"blocks.{l}.attn.hook_pattern"].double()  # [batch, head, query, key]
    n_experts = logits.shape[-1]
    base = dict(step=step, layer=l)
    p = _route_distribution(mlp, logits)
    entropy = -(p * torch.log(p.clamp_min(1e-300))).sum(-1)
    rows = [dict(base, **{"class": "all"}, expert=None, metric="router_entropy",
                 value=float(entropy[visible].mean()), reason="")]
    rows_visible = visible[:, None, :, None].to(pattern.dtype)
    received = (pattern * rows_visible).sum(dim=(1, 2)) / (rows_visible.sum(dim=(1, 2)) * pattern.shape[1])
    anchors = detect_anchors(received, key_visible=visible) & visible
    classes = {"prompt": prompt & visible, "canvas": ~prompt & visible, "anchor": anchors,
               "non_anchor": visible & ~anchors}
    loads = {}
    for name, where in classes.items():
        rows.append(dict(base, **{"class": name}, expert=None, metric="positions", value=float(where.sum()),
                         reason=""))
        loads[name] = _load(index, where, n_experts)
        if loads[name] is None:
            rows.append(dict(base, **{"class": name}, expert=None, metric="load", value=float("nan"),
                             reason=f"no {name.replace('_', '-')} position"))
            continue
        rows.extend(dict(base, **{"class": name}, expert=e, metric="load", value=float(v), reason="")
                    for e, v in enumerate(loads[name].tolist()))
    a, r = loads["anchor"], loads["non_anchor"]
    if a is None or r is None:
        value, reason = float("nan"), "no anchor at this step and layer" if a is None else "every key is an anchor"
    else:
        value, reason = float(0.5 * (a - r).abs().sum()), ""
    rows.append(dict(base, **{"class": "anchor"}, expert=None, metric="anchor_vs_rest_tv", value=value,
                     reason=reason))
    return rows
