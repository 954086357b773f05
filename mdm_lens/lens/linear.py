"""Linear probes over (layer × step) on activations recorded along denoising trajectories.

    out = model.generate(prompts, steps=8, gen_length=8, cache="blocks.*.hook_resid_post" @ steps(every=1))
    feats = features_from_cache(out.cache, pool="mean", positions=out.trajectory.x_steps[out.cache.steps]
                                == model.cfg.mask_token_id)           # mean over the still-masked positions
    table = probe_grid(feats, correct, probe="logistic")               # AUC + accuracy per (layer, step)
    table = probe_grid(feats, "step", probe="ridge", pool_steps=True)  # R² of the latent step per layer

Pooling (`features_from_cache(pool=...)`): "mean" averages the chosen positions of each item at each step (one
sample per item and step), "last" takes the last chosen position, "none" keeps every chosen position as a sample
of its item (per-position probes; targets may then be `[item, pos]` or `[step, item, pos]`).

Splits are by ITEM, drawn once (seeded) and shared by every cell: an item is in the test split at every layer
and step, and when `pool_steps=True` stacks the steps of a layer into one probe, all steps of an item fall on
the same side -- a probe can never be scored on an item whose other steps it was trained on. With an item-level
categorical target the split is stratified by class.

Probes, on features standardised with the train samples' mean and std:
- "logistic": L2-penalised (mean log-loss + l2/2 |W|², bias free), fit by torch LBFGS from zeros in float64
  (deterministic); binary for two classes, softmax for more. Metrics "auc" (Mann-Whitney with mid-ranks; more
  than two classes: the macro mean of one-vs-rest AUCs) and "accuracy".
- "ridge": closed form (intercept free; alpha=0 is least squares, minimum norm). Metric "r2" = 1 - SS_res/SS_tot
  with the test split's own mean.
Confidence intervals: percentile bootstrap over TEST ITEMS (an item's samples move together), seeded. A metric
that is undefined (one class in the test split, a constant test target) is NaN with a `reason`, never 0.5 or 0.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch
from jaxtyping import Bool, Float
from torch import Tensor

from mdm_lens import validate
from mdm_lens.lens.metrics import _auc_weighted, _r2_weighted, auc, r2  # noqa: F401 (public here too)
from mdm_lens.errors import ArgumentError, ArgumentTypeError, InputError

__all__ = ["ProbeFeatures", "features_from_cache", "item_split", "auc", "r2", "fit_logistic", "fit_ridge",
           "probe_grid", "POOLS", "PROBES", "POOLED", "COLUMNS"]

POOLS = ("mean", "last", "none")
PROBES = ("logistic", "ridge")
POOLED = -1  # the `step` of a row whose probe pooled all steps of a layer (`pool_steps=True`)
COLUMNS = ["layer", "step", "metric", "value", "ci_low", "ci_high", "n_train", "n_test", "reason"]
_STD_FLOOR = 1e-12  # a feature whose train std is below this is constant: centred, not scaled
_SMALL = 1 << 20    # cells with fewer feature entries than this are fit on one CPU thread (see _threads_for)


@contextmanager
def _threads_for(numel: int):
    """One intra-op thread for a small cell, restored afterwards. Why: a probe cell is ~1000 tiny ops (LBFGS
    closures, bootstrap rows); with several threads each op pays a thread-pool barrier, which on a busy CPU
    costs ~20 ms instead of ~0.3 ms -- a 2-thread fit measured 80x slower than a 1-thread one here."""
    before = torch.get_num_threads()
    if numel < _SMALL and before > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


@dataclass
class ProbeFeatures:
    """Activations for `probe_grid`: `acts` is `[layer, step, item, d]` (pooled) or `[layer, step, item, pos, d]`
    (`pool="none"`; `positions [step, item, pos]` then says which positions are samples). `layers` / `steps`
    label the first two axes in the output table (model layers, run steps)."""

    acts: Float[Tensor, "layer step item *pos d"]
    layers: list[int]
    steps: list[int]
    positions: Bool[Tensor, "step item pos"] | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        validate.tensor(self.acts, name="acts", ndim=(4, 5), dtype="float")
        n_layer, n_step = self.acts.shape[:2]
        self.layers = [validate.integer(v, name=f"layers[{i}]") for i, v in enumerate(self.layers)]
        self.steps = [validate.integer(v, name=f"steps[{i}]") for i, v in enumerate(self.steps)]
        if len(self.layers) != n_layer or len(self.steps) != n_step:
            raise ArgumentError(f"layers ({len(self.layers)}) and steps ({len(self.steps)}) must label the "
                                f"{n_layer} x {n_step} leading axes of acts.", argument="layers", value=self.layers,
                                allowed=f"{n_layer} layers and {n_step} steps")
        if self.acts.ndim == 5:
            shape = tuple(self.acts.shape[1:4])
            if self.positions is None:
                self.positions = torch.ones(shape, dtype=torch.bool)
            self.positions = _per_step(self.positions, shape, name="positions")
        elif self.positions is not None:
            raise ArgumentError("positions only go with per-position acts [layer, step, item, pos, d].",
                                argument="positions", value=self.positions, allowed="None for pooled acts")

    @classmethod
    def of(cls, value: Any) -> "ProbeFeatures":
        if isinstance(value, cls):
            return value
        validate.tensor(value, name="features", ndim=(4, 5), dtype="float")
        return cls(value, list(range(value.shape[0])), list(range(value.shape[1])))


def _per_step(mask: Any, shape: tuple[int, int, int], *, name: str) -> Tensor:
    """A `[item, pos]` or `[step, item, pos]` bool mask, broadcast to `[step, item, pos]`."""
    mask = validate.tensor(mask, name=name, ndim=(2, 3), dtype="bool")
    if tuple(mask.shape[-2:]) != shape[1:] or (mask.ndim == 3 and mask.shape[0] != shape[0]):
        hint = (" (a block run's canvas is rounded up to whole blocks: pad x_steps with False to that width)"
                if mask.shape[-1] < shape[2] else "")
        raise InputError(f"{name} has shape {tuple(mask.shape)}; expected [item, pos] = {list(shape[1:])} or "
                         f"[step, item, pos] = {list(shape)}{hint}.", argument=name, value=mask,
                         allowed=str(list(shape)))
    return mask.cpu().expand(shape)


def features_from_cache(cache: Any, *, hook: str = "hook_resid_post", layers: Any = None, pool: str = "mean",
                        positions: Tensor | None = None, phase: str | None = None) -> ProbeFeatures:
    """Per-layer, per-step features from a `TrajectoryCache` holding `blocks.{layer}.{hook}` at some steps
    (`layers` None: every layer the cache holds for `hook`).

    `positions`: `[item, pos]` or `[step, item, pos]` (aligned with `cache.steps`) bool, canvas positions to pool
    or keep (default all); e.g. `out.trajectory.x_steps[cache.steps] == mask_id` for the still-masked ones (block
    samplers compute a canvas rounded up to whole blocks, wider than `x_steps`: pad it with False). Rows
    are read by absolute position (`cache.stack(..., align=True)`): a position the step's forward did not compute
    (SDAR / Fast-dLLM v2 blocks, `kv_cache` windows, ARM prefixes) or a pad is never chosen (`pool="none"` keeps it
    as NaN, unmarked in `.positions`). "mean" and "last" need at least one chosen position per item and step."""
    if not (hasattr(cache, "stack") and hasattr(cache, "names")):
        raise ArgumentTypeError(f"cache={validate.describe(cache)} is not a TrajectoryCache (out.cache of "
                                "model.generate(..., cache=...)).", argument="cache", value=cache,
                                allowed="a TrajectoryCache")
    if not isinstance(hook, str):
        raise ArgumentTypeError(f"hook={validate.describe(hook)} must be a block hook name such as "
                                "'hook_resid_post'.", argument="hook", value=hook, allowed="a str")
    pool = validate.choice(pool, POOLS, name="pool")
    pattern = re.compile(rf"blocks\.(\d+)\.{re.escape(hook)}$")
    have = sorted(int(m.group(1)) for m in map(pattern.match, cache.names) if m)
    if not have:
        full = re.match(r"blocks\.(\d+)\.(.+)$", hook)
        hint = (f" hook= is the per-layer suffix ({full.group(2)!r}); choose layers with layers=[{full.group(1)}]."
                if full else "")
        raise InputError(f"the cache holds no blocks.*.{hook}; it holds {cache.names}.{hint}", argument="hook",
                         value=hook, allowed="the suffix of a block hook the cache recorded, e.g. 'hook_resid_post'")
    n_layers = cache.model.cfg.n_layers if getattr(cache, "model", None) is not None else max(have) + 1
    # default: the layers the cache holds (not every model layer, which would blame a layers[0] never passed)
    layers = have if layers is None else validate.indices(layers, n_layers, name="layers", what="layer")
    for i, layer in enumerate(layers):
        validate.choice(layer, have, name=f"layers[{i}]", error=InputError)
    # a TrajectoryCache aligns rows by position; a stand-in with `stack` only is taken to hold whole canvases
    by_pos = {"align": True} if hasattr(cache, "computed") else {}
    acts = torch.stack([cache.stack(f"blocks.{l}.{hook}", phase=phase, **by_pos) for l in layers]).detach().cpu()
    validate.tensor(acts, name="cached activations", ndim=5, dtype="float")  # [layer, step, item, pos, d]
    steps = cache.steps if phase is None else cache.steps_of(phase)
    shape = tuple(acts.shape[1:4])
    pos = torch.ones(shape, dtype=torch.bool) if positions is None else _per_step(positions, shape, name="positions")
    if by_pos:
        pos = pos & cache.computed(phase) & cache.visible(phase)  # rows the step computed, pads excluded
    meta = {"hook": hook, "pool": pool}
    if pool == "none":
        return ProbeFeatures(acts, layers, list(steps), pos, meta)
    n_chosen = pos.sum(-1)
    if bool((n_chosen == 0).any()):
        s, i = (n_chosen == 0).nonzero()[0].tolist()
        raise InputError(f"positions selects no position of item {i} at step {steps[s]} among the computed, non-pad "
                         f"ones (that step's rows: {cache.rows_of(steps[s], phase) if by_pos else 'all'}), so pool={pool!r} is undefined there; "
                         "choose other positions or pool='none'.", argument="positions",
                         value=positions, allowed="at least one position per item and step")
    if pool == "mean":
        w = pos.to(acts.dtype)[None, ..., None]
        pooled = torch.where(w > 0, acts, 0.0).sum(-2) / w.sum(-2)  # NaN rows (not computed) get no weight
    else:  # last chosen position
        last = (pos.long() * torch.arange(1, shape[2] + 1)).argmax(-1)          # [step, item]
        idx = last[None, :, :, None, None].expand(acts.shape[0], -1, -1, 1, acts.shape[-1])
        pooled = acts.gather(3, idx).squeeze(3)
    return ProbeFeatures(pooled, layers, list(steps), None, meta)


# ---------------------------------------------------------------------------------------------------------------
# splits and metrics
# ---------------------------------------------------------------------------------------------------------------

@validate.known_keywords
def item_split(n_items: int, *, test_fraction: float = 0.25, seed: int = 0,
               stratify: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(train items, test items), sorted, disjoint, covering `range(n_items)`. `stratify` (`[item]` labels) puts
    round(test_fraction * n_c) items of each class c with at least two items in the test split."""
    n_items = validate.integer(n_items, name="n_items", min=2)
    frac = validate.number(test_fraction, name="test_fraction", min=0.0, max=1.0, min_open=True, max_open=True)
    g = torch.Generator().manual_seed(validate.seed(seed, min=None))
    if stratify is None:
        groups = [torch.arange(n_items)]
    else:
        labels = validate.tensor(stratify, name="stratify", shape=(n_items,), dtype=("int", "bool"))
        groups = [(labels == c).nonzero().flatten() for c in torch.unique(labels)]
    test = []
    for members in groups:
        k = min(max(1, round(frac * len(members))), len(members) - 1) if len(members) >= 2 else 0
        test.append(members[torch.randperm(len(members), generator=g)[:k]])
    test_items = torch.cat(test).sort().values
    if len(test_items) == 0:
        raise InputError(f"a stratified split of {n_items} items leaves no test item (every class has one item).",
                         argument="stratify", value=stratify, allowed="a class with at least two items")
    keep = torch.ones(n_items, dtype=torch.bool)
    keep[test_items] = False
    return keep.nonzero().flatten(), test_items


# ---------------------------------------------------------------------------------------------------------------
# probes
# ---------------------------------------------------------------------------------------------------------------

def fit_logistic(x: Float[Tensor, "n d"], y: Tensor, *, n_classes: int | None = None, l2: float = 1e-2,
                 max_iter: int = 200) -> tuple[Tensor, Tensor]:
    """L2 logistic regression by LBFGS (float64, from zeros: deterministic). `y`: class indices in
    [0, n_classes). Returns (W `[d, 1]`, b `[1]`) for two classes (logit of class 1), else (W `[d, K]`, b `[K]`)."""
    x = validate.tensor(x, name="x", ndim=2, dtype="float", finite=True).double()
    y = validate.tensor(y, name="y", shape=(x.shape[0],), dtype=("int", "bool")).long()
    k = int(y.max()) + 1 if n_classes is None else validate.integer(n_classes, name="n_classes", min=2)
    if int(y.min()) < 0 or int(y.max()) >= k:
        raise InputError(f"y holds classes outside [0, {k}).", argument="y", value=y, allowed=f"ints in [0, {k})")
    l2 = validate.number(l2, name="l2", min=0.0, min_open=True)
    max_iter = validate.integer(max_iter, name="max_iter", min=1)
    d, out = x.shape[1], 1 if k == 2 else k
    params = torch.zeros(d + 1, out, dtype=torch.float64, requires_grad=True)
    yf = y.double()
    opt = torch.optim.LBFGS([params], lr=1.0, max_iter=max_iter, history_size=20, tolerance_grad=1e-10,
                            tolerance_change=1e-14, line_search_fn="strong_wolfe")

    def loss_fn() -> Tensor:
        opt.zero_grad()
        z = x @ params[:d] + params[d]
        # log-loss written out: softplus(z) - y z is the stable binary form (and ~20x faster on CPU than
        # torch's binary_cross_entropy_with_logits for these tiny float64 problems)
        fit = ((torch.nn.functional.softplus(z[:, 0]) - yf * z[:, 0]).mean() if out == 1
               else (torch.logsumexp(z, 1) - z.gather(1, y[:, None])[:, 0]).mean())
        loss = fit + 0.5 * l2 * params[:d].pow(2).sum()
        loss.backward()
        return loss

    with torch.enable_grad(), _threads_for(x.numel()):
        opt.step(loss_fn)
    return params[:d].detach().clone(), params[d].detach().clone()


def fit_ridge(x: Float[Tensor, "n d"], y: Float[Tensor, "n"], *, alpha: float = 1.0) -> tuple[Tensor, Tensor]:
    """Ridge regression in closed form, intercept not penalised: (w `[d]`, b) minimising |y - xw - b|² + alpha|w|²
    (float64). alpha=0: least squares, the minimum-norm solution when x is rank deficient."""
    x = validate.tensor(x, name="x", ndim=2, dtype="float", finite=True).double()
    y = validate.tensor(y, name="y", shape=(x.shape[0],), dtype=("float", "int"), finite=True).double()
    alpha = validate.number(alpha, name="alpha", min=0.0)
    x_mean, y_mean = x.mean(0), y.mean()
    xc, yc = x - x_mean, y - y_mean
    n, d = xc.shape
    if alpha == 0:
        w = torch.linalg.lstsq(xc, yc[:, None], driver="gelsd").solution[:, 0]
    elif n >= d:  # primal: (XᵀX + αI) w = Xᵀy
        w = torch.linalg.solve(xc.T @ xc + alpha * torch.eye(d, dtype=x.dtype), xc.T @ yc)
    else:  # dual: w = Xᵀ (XXᵀ + αI)⁻¹ y, an n x n solve
        w = xc.T @ torch.linalg.solve(xc @ xc.T + alpha * torch.eye(n, dtype=x.dtype), yc)
    return w, y_mean - x_mean @ w


# ---------------------------------------------------------------------------------------------------------------
# the grid
# ---------------------------------------------------------------------------------------------------------------

def _target(target: Any, feats: ProbeFeatures, probe: str, pool_steps: bool) -> Tensor:
    """The target broadcast to `[step, item(, pos)]`: float64 for ridge, class indices for logistic."""
    a = feats.acts
    full = tuple(a.shape[1:4]) if a.ndim == 5 else tuple(a.shape[1:3])
    if isinstance(target, str):
        validate.choice(target, ("step",), name="target")
        if not pool_steps or probe != "ridge":
            raise ArgumentError("target='step' (the latent step) needs probe='ridge' and pool_steps=True: within "
                                "one step it is constant.", argument="target", value=target,
                                allowed="a tensor, or 'step' with ridge and pool_steps=True")
        t = torch.tensor(feats.steps, dtype=torch.float64)
        return t.reshape(-1, *([1] * (len(full) - 1))).expand(full)
    t = validate.tensor(target, name="target", dtype=("float", "int", "bool"), finite=True)
    shapes = {1: full[1:2], len(full) - 1: full[1:], len(full): full}
    if t.ndim not in shapes or tuple(t.shape) != shapes[t.ndim]:
        allowed = " or ".join(str(list(s)) for s in dict.fromkeys(map(tuple, shapes.values())))
        raise InputError(f"target has shape {tuple(t.shape)}; expected {allowed} ([item], [item, pos], "
                         "[step, item, ...]).", argument="target", value=t, allowed=allowed)
    if t.ndim == 1:
        t = t.reshape(-1, *([1] * (len(full) - 2)))
    if probe == "logistic" and t.is_floating_point():
        raise ArgumentTypeError("a logistic probe needs class labels (an int or bool target); use probe='ridge' "
                                "for a real-valued one.", argument="target", value=t, allowed="int or bool tensor")
    return (t.double() if probe == "ridge" else t.long()).cpu().expand(full)


def probe_grid(features: ProbeFeatures | Tensor, target: Tensor | str, *, probe: str = "logistic",
               pool_steps: bool = False, test_fraction: float = 0.25, seed: int = 0, l2: float = 1e-2,
               alpha: float = 1.0, n_boot: int = 1000, ci: float = 0.95, max_iter: int = 200) -> pd.DataFrame:
    """Train one probe per (layer, step) -- or per layer over all steps (`pool_steps`, `step = POOLED`) -- on an
    item split and score it on the held-out items. Returns the tidy table `COLUMNS` (`n_train` / `n_test` count
    ITEMS with a sample in the cell); `table.attrs` holds the split (`train_items`, `test_items`).

    `target`: `[item]`, `[step, item]` (or with per-position features `[item, pos]`, `[step, item, pos]`) labels
    (logistic: int / bool classes) or values (ridge), or "step" (the latent step; ridge + pool_steps)."""
    feats = ProbeFeatures.of(features)
    probe = validate.choice(probe, PROBES, name="probe")
    pool_steps = validate.boolean(pool_steps, name="pool_steps")
    n_boot = validate.integer(n_boot, name="n_boot", min=0)
    ci = validate.number(ci, name="ci", min=0.0, max=1.0, min_open=True, max_open=True)
    opts = dict(l2=validate.number(l2, name="l2", min=0.0, min_open=True),
                alpha=validate.number(alpha, name="alpha", min=0.0),
                max_iter=validate.integer(max_iter, name="max_iter", min=1))
    # each option belongs to one probe kind: set away from its default under the other it would be dropped
    from mdm_lens.probes._ignored import refuse_ignored

    for name, default, owner in (("l2", 1e-2, "logistic"), ("max_iter", 200, "logistic"), ("alpha", 1.0, "ridge")):
        if probe != owner:
            refuse_ignored(name, opts[name], default, by="probe", by_value=probe,
                           why=f"{name} is the {owner} probe's setting")
    y = _target(target, feats, probe, pool_steps)
    n_items = feats.acts.shape[2]
    classes = None
    if probe == "logistic":
        classes, y = torch.unique(y, return_inverse=True)  # labels -> class indices 0..K-1
    strat = y[0].reshape(n_items, -1)[:, 0] if probe == "logistic" and _item_level(target) else None
    train, test = item_split(n_items, test_fraction=test_fraction, seed=seed, stratify=strat)
    a = feats.acts
    use = (feats.positions if a.ndim == 5 else torch.ones(a.shape[1:3], dtype=torch.bool))  # [step, item(, pos)]
    item_of = torch.arange(n_items).reshape(1, -1, *([1] * (use.ndim - 2))).expand(use.shape)
    cells = [(li, None) for li in range(a.shape[0])] if pool_steps else \
        [(li, si) for li in range(a.shape[0]) for si in range(a.shape[1])]
    rows = []
    for li, si in cells:
        sel = slice(None) if si is None else slice(si, si + 1)
        keep = use[sel].reshape(-1)
        x = a[li, sel].reshape(-1, a.shape[-1])[keep]
        step = POOLED if si is None else feats.steps[si]
        with _threads_for(x.numel()):
            cell = _fit_cell(x, y[sel].reshape(-1)[keep], item_of[sel].reshape(-1)[keep], train, test, probe,
                             classes, opts, n_boot, ci, seed)
        rows += [dict(layer=feats.layers[li], step=step, **r) for r in cell]
    table = pd.DataFrame(rows, columns=COLUMNS)
    table.attrs.update(train_items=train.tolist(), test_items=test.tolist(), probe=probe,
                       classes=None if classes is None else classes.tolist(), **feats.meta)
    return table


def _item_level(target: Any) -> bool:
    return isinstance(target, Tensor) and target.ndim == 1


def _fit_cell(x: Tensor, y: Tensor, item: Tensor, train: Tensor, test: Tensor, probe: str, classes: Tensor | None,
              opts: dict, n_boot: int, ci: float, seed: int) -> list[dict]:
    """The metric rows of one cell: fit on the train items' samples, score the test items' samples."""
    metrics = ("auc", "accuracy") if probe == "logistic" else ("r2",)
    k = 0 if classes is None else len(classes)
    is_train, is_test = torch.isin(item, train), torch.isin(item, test)
    test_items = torch.unique(item[is_test])
    counts = dict(n_train=len(torch.unique(item[is_train])), n_test=len(test_items))
    validate.finite(x[is_train | is_test], name="features (the samples of a cell)")

    def undefined(reason: str) -> list[dict]:
        return [dict(metric=m, value=float("nan"), ci_low=float("nan"), ci_high=float("nan"), reason=reason,
                     **counts) for m in metrics]

    if counts["n_train"] == 0 or counts["n_test"] == 0:
        return undefined("no sample of a " + ("train" if counts["n_train"] == 0 else "test") + " item in this cell")
    xtr, ytr, xte, yte = x[is_train].double(), y[is_train], x[is_test].double(), y[is_test]
    mean, std = xtr.mean(0), xtr.std(0, unbiased=False)
    scale = torch.where(std > _STD_FLOOR, std, torch.ones_like(std))
    xtr, xte = (xtr - mean) / scale, (xte - mean) / scale
    if probe == "logistic":
        if len(torch.unique(ytr)) < 2:
            return undefined(f"one class only in the train split ({classes[ytr[0]].item()!r})")
        w, b = fit_logistic(xtr, ytr, n_classes=max(k, 2), l2=opts["l2"], max_iter=opts["max_iter"])
        pred = xte @ w + b
    else:
        w, b = fit_ridge(xtr, ytr, alpha=opts["alpha"])
        pred = xte @ w + b
    # bootstrap over test items: row 0 is the point estimate (every item once), the rest resample items
    g = torch.Generator().manual_seed(seed)
    draws = torch.randint(len(test_items), (n_boot, len(test_items)), generator=g)
    item_w = torch.cat([torch.ones(1, len(test_items)), torch.zeros(n_boot, len(test_items)).scatter_add_(
        1, draws, torch.ones(n_boot, len(test_items)))]).double()
    w_samples = item_w[:, torch.searchsorted(test_items, item[is_test])]
    rows = []
    for m in metrics:
        vals = _metric(m, pred, yte, w_samples, k)
        point, boot = float(vals[0]), vals[1:]
        reason = "" if point == point else _why(m, yte, classes)
        lo = hi = float("nan")
        ok = boot[~torch.isnan(boot)]
        if point == point and n_boot and len(ok) >= n_boot / 2:
            q = torch.quantile(ok, torch.tensor([(1 - ci) / 2, (1 + ci) / 2], dtype=ok.dtype))
            lo, hi = float(q[0]), float(q[1])
            if len(ok) < n_boot:
                reason = f"ci over {len(ok)} of {n_boot} resamples (the others were undefined)"
        elif point == point:
            reason = "no bootstrap (n_boot=0)" if not n_boot else \
                f"ci undefined: {n_boot - len(ok)} of {n_boot} resamples undefined"
        rows.append(dict(metric=m, value=point, ci_low=lo, ci_high=hi, reason=reason, **counts))
    return rows


def _metric(name: str, pred: Tensor, y: Tensor, w: Tensor, k: int) -> Tensor:
    if name == "r2":
        return _r2_weighted(y[None].expand_as(w), pred[:, 0] if pred.ndim == 2 else pred, w)
    if name == "accuracy":
        hit = ((pred[:, 0] > 0).long() if pred.shape[1] == 1 else pred.argmax(1)) == y
        return (w * hit).sum(1) / w.sum(1)
    if pred.shape[1] == 1:
        return _auc_weighted(pred[:, 0], (y == 1).double(), w)
    prob = pred.softmax(1)  # macro one-vs-rest over every class: NaN if any class lacks positives or negatives
    return torch.stack([_auc_weighted(prob[:, c], (y == c).double(), w) for c in range(k)]).mean(0)


def _why(metric: str, y: Tensor, classes: Tensor | None) -> str:
    if metric == "r2" or classes is None:
        return f"constant target in the test split ({float(y[0])!r})"
    present = set(torch.unique(y).tolist())
    missing = [classes[c].item() for c in range(len(classes)) if c not in present]
    have = [classes[c].item() for c in sorted(present)]
    return f"the test split lacks class(es) {missing} (has only {have}), so the AUC is undefined"
