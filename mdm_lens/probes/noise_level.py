"""How attention to anchors and the adaLN gates change with the noise level, on any DDiT model (MDLM, BD3LM, Duo,
GIDD): a table over level × layer.

For each level v (the conditioning input the network reads: σ for MDLM / BD3LM / Duo, the time t for GIDD) one
forward of the same canvas runs with `sigma=v`; per layer it reduces, without storing patterns across layers:
- `anchor_share`: the attention mass the query set puts on the anchor keys, mean over the (batch, head) series that
  have anchors (NaN when none has: undefined, never 0; `n_anchors` counts every series). Anchors are
  detected per (batch, head) by `floating.detect_anchors` (zscore: leave-one-out 3σ and a 2× mass floor) on the
  received mass's *lift* over the uniform-attention null of the same visibility and query set (m_j / (n·u_j): equal
  to m_j under bidirectional attention; under BD3LM's block-causal window it removes the mask's own tilt towards
  early keys);
- `null_share`: what uniform attention under the same visibility would put on those keys (the matching null);
  `top1_share`: the largest received mass (always defined, no detector);
- `n_anchors`: mean anchor count; `gate_msa`, `gate_mlp`: mean |gate| of the block's adaLN (over batch and
  d_model) — the factor each branch's output is scaled by before it reaches the residual.

Query set: `queries="masked"` uses the positions holding [MASK] (MDLM, BD3LM, GIDD's absorbing part); `"all"` every
row (the only meaning for Duo, whose uniform noise has no [MASK]: every position is a possibly-noised token).
`result.meaning` states what "masked" and "anchor" mean for the model that ran; a model that ignores σ
(`time_conditioning` off) gives identical rows, and `result.meaning` says so."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from mdm_lens import validate
from mdm_lens.errors import ArgumentError

from ._results import ResultMixin
from .floating import detect_anchors
from .received import received_attention, uniform_pattern

__all__ = ["NoiseLevelResult", "noise_level", "plot_noise_level"]

METRICS = ("anchor_share", "null_share", "top1_share", "n_anchors", "gate_msa", "gate_mlp")


@dataclass
class NoiseLevelResult(ResultMixin):
    """Fields `[level, layer]` (see the module docstring); `levels` `[level]`, `level_name` "sigma" or "t"."""

    levels: Float[Tensor, "level"]
    level_name: str
    anchor_share: Float[Tensor, "level layer"]
    null_share: Float[Tensor, "level layer"]
    top1_share: Float[Tensor, "level layer"]
    n_anchors: Float[Tensor, "level layer"]
    gate_msa: Float[Tensor, "level layer"]
    gate_mlp: Float[Tensor, "level layer"]
    meaning: str = ""
    n_queries: int = 0
    _dims: ClassVar[dict] = {m: ("level", "layer") for m in METRICS}
    extra: dict = field(default_factory=dict)

    @property
    def excess(self) -> Float[Tensor, "level layer"]:
        """anchor_share − null_share (NaN where no anchor was found in any head: no share to compare)."""
        return self.anchor_share - self.null_share

    @property
    def layers(self) -> list[int]:
        """The model's layer number of each column (the selection as asked, e.g. [2, 1])."""
        return list(self.extra.get("layers", range(self.anchor_share.shape[1])))

    def _coords(self) -> dict[str, Any]:
        # to_frame's `level` is the σ (or t) value and `layer` the model's layer, not their positions
        return {"level": self.levels.tolist(), "layer": self.layers}

    def table(self) -> list[dict[str, Any]]:
        """One row per (level, layer) with every metric; `layer` is the model's layer number."""
        rows = []
        for i, v in enumerate(self.levels.tolist()):
            for j, layer in enumerate(self.layers):
                rows.append({self.level_name: v, "layer": layer,
                             **{m: float(getattr(self, m)[i, j]) for m in METRICS}})
        return rows


def _level_name(model: Any) -> str:
    return "t" if model.cfg.family == "gidd" else "sigma"


def _meaning(model: Any, queries: str) -> str:
    fam, cfg = model.cfg.family, model.cfg
    if fam == "duo":
        what = ("Duo is uniform-state (no [MASK] id, no mask embedding): every position is a possibly-noised token, "
                "the query set is every row, and an anchor is a key whose received mass stands out against the "
                "uniform-attention null 1/T.")
    else:
        what = (f"'masked' = positions holding [MASK] (id {cfg.mask_token_id}); an anchor is a key whose received "
                "mass stands out against uniform attention under the forward's visibility")
        what += (" (BD3LM: the block-causal window)." if fam == "bd3lm" else " (bidirectional: 1/T).")
        if fam == "gidd":
            what += (f" GIDD's noise is hybrid (p_uniform={cfg.extra['p_uniform']}): [MASK] marks only its "
                     "absorbing part; uniformly replaced tokens are not distinguishable and count as unmasked.")
    what += f" Query set: {queries} rows."
    if not cfg.extra.get("time_conditioning", True):
        what += " time_conditioning is off: the network zeroes σ, so every level gives the same row."
    return what


def _query_mask(model: Any, tokens: Tensor, queries: str) -> Bool[Tensor, "batch pos"]:
    if queries == "all":
        return torch.ones_like(tokens, dtype=torch.bool)
    if model.cfg.mask_token_id is None:
        raise ArgumentError(f"queries='masked': {model.cfg.family} has no [MASK] token (uniform-state noise); use "
                            "queries='all'.", argument="queries", value=queries, allowed="'all'")
    q = tokens == model.cfg.mask_token_id
    if not bool(q.any(-1).all()):
        raise ArgumentError("queries='masked': some rows of tokens hold no [MASK]; the anchor share over an empty "
                            "query set is undefined.", argument="tokens", value=tokens,
                            allowed="every row with at least one mask id")
    return q


def _reduce_layer(pattern: Tensor, qmask: Tensor, null_pattern: Tensor) -> dict[str, Tensor]:
    """Per (batch, head): anchors on the lift over the null, their mass, the null's mass, the top-1 mass."""
    b, h, n, _ = pattern.shape
    q = qmask[:, None].expand(b, h, n)
    m = received_attention(pattern.double(), query_mask=q)  # [b, h, key]
    u = received_attention(null_pattern.expand(b, h, n, n), query_mask=q)
    anchors = detect_anchors(m / (n * u).clamp_min(1e-30), rule="zscore")
    share = (m * anchors).sum(-1)
    found = anchors.any(-1)
    nan = torch.tensor(float("nan"), dtype=share.dtype)
    return dict(anchor_share=torch.where(found, share, nan), null_share=torch.where(found, (u * anchors).sum(-1), nan),
                top1_share=m.max(-1).values, n_anchors=anchors.sum(-1).double())


def _nanmean(x: Tensor) -> float:
    return float(x.nanmean()) if bool((~x.isnan()).any()) else float("nan")


@validate.known_keywords
def noise_level(model: Any, tokens: Any, levels: Sequence[float] | Tensor, *, queries: str = "all",
                layers: Sequence[int] | None = None) -> NoiseLevelResult:
    """The level × layer table on one canvas `tokens` `[batch, pos]` (MDLM / Duo / GIDD: pos ≤ n_ctx; BD3LM: its
    sampling form, a window under the block-causal mask).

    Args:
        levels: conditioning values to sweep (σ ≥ 0; GIDD: t in [0, 1]).
        queries: "all" or "masked" (positions holding the mask id; refused for Duo).
        layers: the layers to report (default all): an int, a slice or distinct ints, negatives counting from the
            end (`validate.indices`, as the lenses); an empty or repeated selection is refused.
    An undefined anchor share (no anchor in any head at that level and layer) is NaN, with `n_anchors` 0."""
    from mdm_lens.ddit.model import HookedDDiT

    if not isinstance(model, HookedDDiT):
        raise ArgumentError(f"model={type(model).__name__}: the noise-level probe reads the adaLN gates and the "
                            "σ input of DDiT models (MDLM, BD3LM, Duo, GIDD).", argument="model",
                            value=type(model).__name__, allowed="a HookedDDiT")
    queries = validate.choice(queries, ("all", "masked"), name="queries")
    tokens = validate.tensor(tokens, name="tokens", ndim=2, dtype="int").to(model.input_device)
    lv = validate.tensor(torch.as_tensor(levels, dtype=torch.float32), name="levels", ndim=1)
    if lv.numel() == 0:
        raise ArgumentError("levels is empty.", argument="levels", value=levels, allowed="one value or more")
    values = lv.tolist()
    for i, v in enumerate(values):  # named here: the forward would blame its own `sigma=` argument
        validate.number(v, name=f"levels[{i}]", min=0, max=1 if model.cfg.family == "gidd" else None)
    repeated = sorted({v for v in values if values.count(v) > 1})
    if repeated:  # as a repeated layer or step: a second row of the same level is no new measurement
        raise ArgumentError(f"levels={values} repeats {repeated}; give each level once.", argument="levels",
                            value=values, allowed="distinct levels")
    if not model.cfg.extra.get("time_conditioning", True) and lv.numel() > 1:
        import warnings

        warnings.warn(f"{model.cfg.model_name}: time_conditioning is off, so the network zeroes σ and every level "
                      "gives the same row (result.meaning says so); compare levels on a time-conditioned model.",
                      UserWarning, stacklevel=2)
    # the library's layer selection: negatives count from the end, an empty or repeated selection is refused
    layers = validate.indices(layers, model.cfg.n_layers, name="layers", what="layer")
    qmask = _query_mask(model, tokens, queries)
    n = tokens.shape[1]
    block = model.cfg.extra.get("block_size") if model.cfg.family == "bd3lm" else None
    null_pattern = uniform_pattern(n, block_length=block)
    out = {m: torch.full((lv.numel(), len(layers)), float("nan"), dtype=torch.float64) for m in METRICS}
    for i, v in enumerate(lv.tolist()):
        got = _run_level(model, tokens, v, layers, qmask, null_pattern)
        for j, layer in enumerate(layers):
            for m in METRICS:
                out[m][i, j] = got[layer][m]
    return NoiseLevelResult(levels=lv, level_name=_level_name(model), meaning=_meaning(model, queries),
                            n_queries=int(qmask.sum()), extra=dict(layers=layers), **out)


def _run_level(model: Any, tokens: Tensor, v: float, layers: list[int], qmask: Tensor, null_pattern: Tensor
               ) -> dict[int, dict[str, float]]:
    got: dict[int, dict[str, float]] = {layer: {} for layer in layers}

    def on_pattern(layer: int):
        def hook(pattern: Tensor, hook: Any) -> None:
            r = _reduce_layer(pattern.detach(), qmask, null_pattern.to(pattern.device))
            got[layer].update({k: _nanmean(t) if k in ("anchor_share", "null_share") else float(t.mean())
                               for k, t in r.items()})
        return hook

    def on_gate(layer: int, name: str):
        def hook(gate: Tensor, hook: Any) -> None:
            got[layer][name] = float(gate.detach().abs().float().mean())
        return hook

    hooks = []
    for layer in layers:
        hooks += [(f"blocks.{layer}.attn.hook_pattern", on_pattern(layer)),
                  (f"blocks.{layer}.adaLN.hook_gate_msa", on_gate(layer, "gate_msa")),
                  (f"blocks.{layer}.adaLN.hook_gate_mlp", on_gate(layer, "gate_mlp"))]
    with torch.no_grad():
        model.run_with_hooks(tokens, sigma=v, return_type=None, fwd_hooks=hooks)
    return got


def plot_noise_level(result: NoiseLevelResult, ax: Any = None) -> Any:
    """Three panels against the level, one line per layer: anchor share (dashed: its null), mean |gate_msa|,
    mean |gate_mlp|. Returns the matplotlib figure."""
    import matplotlib.pyplot as plt

    if ax is None:
        fig, ax = plt.subplots(1, 3, figsize=(12, 3.4))
    else:
        fig = ax[0].figure
    x = result.levels.numpy()
    for j, layer in enumerate(result.layers):
        line, = ax[0].plot(x, result.anchor_share[:, j].numpy(), marker="o", label=f"L{layer}")
        ax[0].plot(x, result.null_share[:, j].numpy(), ls="--", color=line.get_color(), alpha=0.6)
        ax[1].plot(x, result.gate_msa[:, j].numpy(), marker="o", color=line.get_color())
        ax[2].plot(x, result.gate_mlp[:, j].numpy(), marker="o", color=line.get_color())
    titles = ("anchor attention share (-- uniform null)", "mean |gate_msa|", "mean |gate_mlp|")
    for a, title in zip(ax, titles):
        a.set_title(title, fontsize=9)
        a.set_xlabel(result.level_name)
    ax[0].legend(fontsize=7)
    fig.tight_layout()
    return fig
