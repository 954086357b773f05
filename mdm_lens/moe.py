"""Mixture-of-experts feed-forward layers for the 2026 families (LLaDA2.x, LLaDA-MoE, SDAR-MoE, RND1).

One module, `MoEMLP`, covers the three routers; `cfg.extra["moe"]` says which (written by the loaders):

- `score="sigmoid"` (LLaDA2): router logits in fp32, sigmoid scores; `expert_bias` is added for the *choice*
  only; group-limited top-k (the experts are split in `n_group` groups, a group's score is the sum of its
  two best scores, only the `topk_group` best groups compete); the chosen scores are renormalised (+1e-20)
  and scaled by `routed_scaling_factor`; the weighted sum runs in fp32.
- `score="softmax"` (LLaDA-MoE, Qwen3-MoE / SDAR-MoE): softmax in fp32, plain top-k. LLaDA-MoE's reference
  adds `expert_bias` to the probabilities themselves, so the bias changes the weights too (reproduced);
  Qwen3-MoE renormalises only with `norm_topk_prob`. Weights are cast to the activation dtype (RND1 keeps them
  fp32 until the product: `fp32_weights`) and the experts are summed in expert order (`index_add_`), as the
  references do.

Hooks (names shared with the DiffusionGemma bridge): `hook_router_logits` `[batch, pos, expert]`,
`hook_expert_indices` / `hook_expert_weights` `[batch, pos, top_k]` (the weights after renormalisation and
scaling, i.e. what multiplies each expert), `hook_experts_out` `[batch, pos, d_model]` (the routed sum) and
`hook_shared_out` (the shared expert's output). Editing the indices re-gathers the weights for the new choice.
Per-expert weights are `experts.{e}.gate_up_weight / down_weight` (TL views `experts[e].W_gate/W_in/W_out`).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from mdm_lens.module_list import IndexedModules
from mdm_lens import validate
from mdm_lens.components import GatedMLP
from mdm_lens.config import MDMConfig
from mdm_lens.errors import ArgumentError, ConfigError
from mdm_lens.hook_surface import bound_indices


def select_experts(scores: Float[Tensor, "token expert"], top_k: int, n_group: int = 1, topk_group: int = 1
                   ) -> Int[Tensor, "token top_k"]:
    """Indices of the `top_k` experts per token, restricted to the `topk_group` best of `n_group` groups.

    A group's score is the sum of its two highest scores (LLaDA2 / DeepSeek-V3's rule); with `n_group=1` this
    is plain top-k. Ties are broken as `torch.topk` breaks them, exactly like the reference."""
    scores = validate.tensor(scores, name="scores", ndim=2, dtype="float")
    n_expert = scores.shape[1]
    top_k = validate.integer(top_k, name="top_k", min=1, max=n_expert)
    n_group = validate.integer(n_group, name="n_group", min=1, max=n_expert)
    if n_expert % n_group:
        raise ArgumentError(f"n_group={n_group} does not divide the {n_expert} experts.", argument="n_group",
                            value=n_group, allowed=f"a divisor of {n_expert}")
    topk_group = validate.integer(topk_group, name="topk_group", min=1, max=n_group)
    if n_group > 1:
        per_group = n_expert // n_group
        if per_group < 2:
            raise ArgumentError(f"n_group={n_group} leaves {per_group} expert per group; a group's score is the sum "
                                "of its two best experts.", argument="n_group", value=n_group,
                                allowed=f"at most {n_expert // 2}")
        group_scores = scores.view(-1, n_group, per_group).topk(2, dim=-1).values.sum(dim=-1)
        best_groups = group_scores.topk(topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        scores = scores.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))
    return scores.topk(top_k, dim=-1).indices


def expert_config(cfg: MDMConfig, d_mlp: int) -> Any:
    """What `GatedMLP` reads from a config (width, d_model, dtype), for an expert of width `d_mlp`."""
    return SimpleNamespace(d_mlp=d_mlp, d_model=cfg.d_model, dtype=cfg.dtype)


class MoEMLP(nn.Module):
    """Routed experts (+ optional shared expert). See the module docstring for the three routers."""

    def __init__(self, cfg: MDMConfig):
        super().__init__()
        spec = cfg.extra["moe"]
        self.n_experts, self.top_k = int(spec["n_experts"]), int(spec["top_k"])
        self.score = spec["score"]
        self.n_group, self.topk_group = int(spec.get("n_group", 1)), int(spec.get("topk_group", 1))
        self.scaling = float(spec.get("scaling", 1.0))
        self.renorm = bool(spec.get("renorm", False))
        self.renorm_eps = float(spec.get("renorm_eps", 0.0))
        # RND1 keeps the softmax weights fp32 up to the product with the expert output (Qwen3-MoE casts them first)
        self.fp32_weights = bool(spec.get("fp32_weights", False))
        self.bias_mode = spec.get("expert_bias")  # None | "selection" (LLaDA2) | "weights" (LLaDA-MoE)
        self.router_weight = nn.Parameter(torch.empty(self.n_experts, cfg.d_model, dtype=cfg.dtype))
        if self.bias_mode is not None:
            self.register_buffer("expert_bias", torch.zeros(self.n_experts, dtype=cfg.dtype))
        else:
            self.expert_bias = None
        self.experts = IndexedModules((GatedMLP(expert_config(cfg, int(spec["d_expert"])))
                                       for _ in range(self.n_experts)), "expert")
        d_shared = spec.get("d_shared")
        self.shared_expert = GatedMLP(expert_config(cfg, int(d_shared))) if d_shared else None
        for name in ("hook_router_logits", "hook_expert_indices", "hook_expert_weights", "hook_experts_out"):
            setattr(self, name, HookPoint())
        bound_indices(self.hook_expert_indices, self.n_experts)
        if self.shared_expert is not None:  # only where it fires
            self.hook_shared_out = HookPoint()

    # --- TL's dense-MLP views do not exist here: say where the weights are ---------------------------
    def _no_dense_view(self, name: str) -> Tensor:
        raise ConfigError(f"an MoE layer has no single {name}: use mlp.experts[e].{name} (routed expert e) or "
                          "mlp.shared_expert." + name + " (the shared expert, where there is one).")

    W_in = property(lambda self: self._no_dense_view("W_in"))
    W_gate = property(lambda self: self._no_dense_view("W_gate"))
    W_out = property(lambda self: self._no_dense_view("W_out"))

    # --- routing ------------------------------------------------------------------------------------
    def router_logits(self, flat: Float[Tensor, "token d_model"]) -> Float[Tensor, "token expert"]:
        if self.score == "sigmoid":  # LLaDA2 computes the gate in fp32 whatever the activation dtype
            return F.linear(flat.float(), self.router_weight.float())
        return F.linear(flat, self.router_weight)

    def _choice_and_source(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """(scores the top-k chooses on, scores the weights are gathered from)."""
        if self.score == "sigmoid":
            scores = torch.sigmoid(logits.float())
            choice = scores + self.expert_bias if self.bias_mode == "selection" else scores
            return choice, scores
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        if self.bias_mode == "weights":  # LLaDA-MoE's reference: the bias moves the weights as well
            probs = probs + self.expert_bias
        return probs, probs

    def route(self, flat: Tensor, shape: tuple[int, int]) -> tuple[Tensor, Tensor]:
        """(expert indices, expert weights) `[token, top_k]`, firing the router hooks."""
        b, p = shape
        logits = self.hook_router_logits(self.router_logits(flat).view(b, p, -1)).reshape(b * p, -1)
        choice, source = self._choice_and_source(logits)
        groups = (self.n_group, self.topk_group) if self.score == "sigmoid" else (1, 1)
        index = select_experts(choice, self.top_k, *groups)
        index = self.hook_expert_indices(index.view(b, p, -1)).reshape(b * p, -1)
        weights = source.gather(1, index)
        if self.renorm and (self.top_k > 1 or self.score != "sigmoid"):  # LLaDA2 skips it for top_k = 1
            weights = weights / (weights.sum(dim=-1, keepdim=True) + self.renorm_eps)
        if self.score == "sigmoid":
            weights = weights * self.scaling
        elif not self.fp32_weights:
            weights = weights.to(flat.dtype)
        weights = self.hook_expert_weights(weights.view(b, p, -1)).reshape(b * p, -1)
        return index, weights

    # --- forward ------------------------------------------------------------------------------------
    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        b, p, d = x.shape
        flat = x.reshape(b * p, d)
        index, weights = self.route(flat, (b, p))
        routed = self._combine_slots(flat, index, weights) if self.score == "sigmoid" else \
            self._combine_experts(flat, index, weights)
        out = self.hook_experts_out(routed.view(b, p, d))
        if self.shared_expert is not None:
            out = out + self.hook_shared_out(self.shared_expert(x))
        return out

    def _dispatch(self, flat: Tensor, index: Tensor) -> tuple[Tensor, Tensor, Tensor, list[int]]:
        """Rows grouped by expert with one stable sort: (order, token of each sorted row, the sorted rows,
        rows per expert). Within an expert the tokens stay ascending (a token picks an expert at most once), so
        each expert sees the same rows in the same order as a per-expert `torch.where`; profiled: one sort,
        one gather and one scatter instead of a mask, `nonzero`, gather and scatter per expert."""
        order = index.reshape(-1).argsort(stable=True)
        counts = torch.bincount(index.reshape(-1), minlength=self.n_experts).tolist()
        token = order // index.shape[1]
        return order, token, flat[token], counts

    def _run_experts(self, rows: Tensor, counts: list[int]) -> list[tuple[int, slice, Tensor]]:
        out, start = [], 0
        for e, n in enumerate(counts):
            if n:
                sl = slice(start, start + n)
                out.append((e, sl, self.experts[e](rows[sl][None])[0]))
                start += n
        return out

    def _combine_slots(self, flat: Tensor, index: Tensor, weights: Tensor) -> Tensor:
        """LLaDA2: each (token, slot) output, then the fp32 weighted sum over slots, cast back."""
        order, _, rows, counts = self._dispatch(flat, index)
        merged = torch.empty_like(rows)
        merged[order] = torch.cat([y for _, _, y in self._run_experts(rows, counts)])
        slots = merged.view(*index.shape, flat.shape[-1])
        return (slots.to(weights.dtype) * weights[..., None]).sum(dim=1).to(flat.dtype)

    def _combine_experts(self, flat: Tensor, index: Tensor, weights: Tensor) -> Tensor:
        """LLaDA-MoE / Qwen3-MoE: `expert(x)·w` accumulated expert by expert with `index_add_`."""
        order, token, rows, counts = self._dispatch(flat, index)
        slot = order % index.shape[1]
        out = torch.zeros_like(flat)
        for _, sl, y in self._run_experts(rows, counts):
            out.index_add_(0, token[sl], (y * weights[token[sl], slot[sl], None]).to(flat.dtype))
        return out
