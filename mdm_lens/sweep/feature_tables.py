"""The sweep's ``features`` probe: every layer's residual stream at every denoising step of each item's run,
pooled to one vector per (item, step, layer), with the item's targets -- the input of linear probes over
layer × step (:func:`mdm_lens.lens.probe_grid`; the report's section: :mod:`mdm_lens.views.fig_probes`).

One row per (item, step, layer), ``COLUMNS``:

* ``feature``: ``blocks.{layer}.hook_resid_post`` at step ``step`` of the batch's shared sampler run, averaged
  over the canvas positions still masked in that step's input (``out.trajectory.x_steps[step] == mask``; the
  prompt is never pooled) that the step's forward computes (block runs: up to the block's end), float32, a list of
  ``d_model`` values; ``n_masked`` counts every masked canvas position of that step (the lens table's
  ``n_masked``), ``note`` says when fewer were pooled. A step with no masked (computed) position gives an all-NaN
  vector with the reason in ``note`` (a mean over nothing).
  The residuals come from replaying each step's forward (one extra forward per step, pooled inside the hook:
  nothing ``[step, pos, d]`` is kept), so a row equals the same pooling of
  ``model.generate(..., cache="blocks.*.hook_resid_post" @ steps())`` run on the item alone, to float rounding.
* targets, the same on every row of an item: ``acc`` (normalised gold answer is a substring of the generated
  answer) and ``em`` (exact match), scored by the ``accuracy`` probe's own function on the same run, so they
  equal its ``with_context`` rows; ``gold_index``, the gold passage when the item has exactly one. An undefined
  target is NA with the reason in ``target_note``.

Causal (ARM) runs have no masked canvas: one row per item, NaN feature, ``note`` says why. So do sampler runs
that cannot be replayed (Fast-dLLM ``kv_cache`` runs, Fast-dLLM v2 with ``use_block_cache``), with the replay's
reason.

Memory: the rows of a sweep are ``items × steps × layers × d_model`` float32 values, merged into one table. A
sweep whose estimate exceeds the budget (``DEFAULT_BUDGET``, 256 MiB; ``MDM_LENS_FEATURES_BUDGET_MB``
overrides it) is refused with :class:`~mdm_lens.errors.MemoryBudgetError` before anything runs
(:func:`check_budget`, called by the runner through ``adapter.preflight`` and again per run).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from mdm_lens import validate
from mdm_lens.noisy import noisy_positions
from mdm_lens.errors import MemoryBudgetError, SamplerConfigError
from mdm_lens.diffusion.replay import replay_rows
from mdm_lens.hooks import memory

__all__ = ["features", "masked_mean_residuals", "check_budget", "estimate_bytes", "budget_bytes", "COLUMNS", "HOOK",
           "DEFAULT_BUDGET", "BUDGET_ENV"]

HOOK = "hook_resid_post"
COLUMNS = ["item_id", "step", "layer", "n_masked", "feature", "note", "acc", "em", "gold_index", "target_note"]
DEFAULT_BUDGET = 256 * 2 ** 20
BUDGET_ENV = "MDM_LENS_FEATURES_BUDGET_MB"
_INT = ("step", "layer", "n_masked", "gold_index")


# --- budget -----------------------------------------------------------------------------------------

def budget_bytes() -> int:
    """The features budget: ``MDM_LENS_FEATURES_BUDGET_MB`` (MiB) when set, else ``DEFAULT_BUDGET``."""
    mib = memory.env_amount(BUDGET_ENV, unit="MiB")
    return DEFAULT_BUDGET if mib is None else int(mib * 2 ** 20)


def estimate_bytes(model: Any, n_items: int, n_steps: int) -> int:
    """Bytes of the pooled features of ``n_items`` items × ``n_steps`` steps × every layer × d_model, float32 (the
    trajectory-cache estimate of ``hook_resid_post`` at every layer with one pooled position)."""
    n_items = validate.integer(n_items, name="n_items", min=0)
    n_steps = validate.integer(n_steps, name="n_steps", min=0)
    names = [f"blocks.{layer}.{HOOK}" for layer in range(model.cfg.n_layers)]
    return memory.estimate_bytes(model.cfg, names, n_steps, n_items, 1, 4)


def check_budget(model: Any, n_items: int, n_steps: int, budget: int | None = None) -> int:
    """The estimate (bytes) of :func:`estimate_bytes`; raises ``MemoryBudgetError`` when it exceeds ``budget``
    (default :func:`budget_bytes`), naming what to run instead."""
    budget = budget_bytes() if budget is None else validate.integer(budget, name="budget", min=1)
    need = estimate_bytes(model, n_items, n_steps)
    if need > budget:
        c = model.cfg
        raise MemoryBudgetError(
            f"the sweep's features table would hold {memory.human(need)} ({n_items} items × {n_steps} steps × "
            f"{c.n_layers} layers × d_model {c.d_model}, float32) but its budget is {memory.human(budget)}. Sweep "
            "fewer items (--limit) or fewer denoising steps (--steps); or export the residuals at a selection of "
            "steps to disk, e.g. `mdm-lens export-activations --hooks 'blocks.*.hook_resid_post' --steps every=4 "
            "--positions masked`, or in Python `model.generate(..., cache='blocks.*.hook_resid_post' @ "
            "steps(every=4))` + `mdm_lens.lens.features_from_cache` on a subset. Raise the budget with "
            f"{BUDGET_ENV}=<MiB> if you have the memory.")
    return need


# --- residuals --------------------------------------------------------------------------------------

def masked_mean_residuals(model: Any, out: Any) -> tuple[Float[Tensor, "step layer batch d_model"], Tensor, Tensor]:
    """``blocks.{l}.hook_resid_post`` of every layer at every step of the run ``out``, averaged over the canvas
    positions masked in that step's input that the step's forward computes: (``[step, layer, batch, d_model]``
    float32 on CPU, NaN where none is; ``n_masked [step, batch]``, every canvas position masked in the step's input;
    ``n_pooled [step, batch]``, the ones averaged). Each step's forward is replayed with hooks that pool as the
    layer is computed; its rows are mapped to canvas positions through the replayed state's ``rows``
    (``DenoisingState.query_rows``): a block run's (llada2 / sdar / fastdllm_v2) step covers the canvas up to its
    block's end, so masked positions of later blocks are counted in ``n_masked`` but not pooled."""
    S, P = out.n_steps, out.prompt_length
    x = out.trajectory.x_steps
    masked = noisy_positions(model.cfg, x, P).clone()                              # [step, batch, pos]
    masked[:, :, :P] = False  # the prompt is never pooled (fastdllm_v2 right-pads prompts with the mask id)
    n_masked = masked.sum(-1)
    L, B, d = model.cfg.n_layers, masked.shape[1], model.cfg.d_model
    pooled = torch.full((S, L, B, d), float("nan"), dtype=torch.float32)
    n_pooled = torch.zeros(S, B, dtype=torch.long)
    for s in range(S):
        rows = replay_rows(out, s)  # the rows the replay's hooks see
        hi = min(rows.stop, x.shape[-1])  # a block canvas may run past prompt + gen_length: not answer
        w = torch.zeros(B, rows.stop - rows.start)
        w[:, :max(hi - rows.start, 0)] = masked[s, :, rows.start:hi].float()
        n_pooled[s] = w.sum(-1).long()
        w = w.to(device=model.input_device)[..., None]                                # [batch, rows, 1]

        def hook_for(layer: int, s: int = s, w: Tensor = w) -> Callable:
            def fn(resid: Tensor, hook: Any) -> None:
                # 0/0 = NaN where nothing is pooled: the mean over no position is undefined, not 0
                pooled[s, layer] = ((resid.float() * w).sum(1) / w.sum(1)).cpu()
            return fn

        out.replay(model, s, fwd_hooks=[(f"blocks.{layer}.{HOOK}", hook_for(layer)) for layer in range(L)])
    return pooled, n_masked, n_pooled


def _note(n: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Why a feature is NaN (nothing masked / none of the masked positions computed) or partial."""
    return np.where(n == 0, "no canvas position is masked at this step",
                    np.where(k == 0, "the step's forward computes none of the masked positions (later blocks)",
                             np.where(k < n, np.char.add(np.char.add("pooled over ", k.astype(str)),
                                                         " masked positions the step's forward computes"), None)))


# --- targets ----------------------------------------------------------------------------------------

def _subset(batch: Any, idx: list[int]) -> Any:
    """The rows ``idx`` of a sweep ``Batch`` (every per-row field cut alike)."""
    pick = lambda xs: None if xs is None else [xs[i] for i in idx]  # noqa: E731
    return dataclasses.replace(batch, rendered=pick(batch.rendered), nocontext=pick(batch.nocontext),
                               ids=batch.ids[idx], attention_mask=batch.attention_mask[idx],
                               offsets=pick(batch.offsets), item_ids=pick(batch.item_ids), seeds=pick(batch.seeds),
                               order=pick(batch.order))


def _targets(model: Any, batch: Any, out: Any, score: Callable) -> pd.DataFrame:
    """Per item: acc, em (``score`` = the accuracy probe's row function, on the run's generated ids), gold_index."""
    generated = out.tokens[:, out.prompt_length:].tolist()
    answered = [i for i, r in enumerate(batch.rendered) if r.item.answers]
    scores: dict[tuple[str, str], float] = {}
    if answered:
        sub = _subset(batch, answered)
        for row in score(model, sub, sub.rendered, [generated[i] for i in answered], "with_context"):
            scores[(row["item_id"], row["metric"])] = float(row["value"])
    rows = []
    for item_id, r in zip(batch.item_ids, batch.rendered):
        notes = [] if r.item.answers else ["acc/em: the item has no gold answer"]
        gold = tuple(r.qa.gold_indices) if r.qa is not None else ()
        if len(gold) != 1:
            notes.append("gold_index: " + ("the item has no passages" if not r.item.passages else
                                           "no gold passage is marked" if not gold else
                                           f"{len(gold)} gold passages, not one"))
        rows.append(dict(item_id=item_id, acc=scores.get((item_id, "acc"), np.nan),
                         em=scores.get((item_id, "em"), np.nan), gold_index=gold[0] if len(gold) == 1 else pd.NA,
                         target_note="; ".join(notes) or None))
    return pd.DataFrame(rows)


# --- the probe --------------------------------------------------------------------------------------

def _finish(df: pd.DataFrame) -> pd.DataFrame:
    for c in _INT:
        df[c] = df[c].astype("Int64")
    for c in ("note", "target_note"):
        df[c] = df[c].astype("string")
    for c in ("acc", "em"):
        df[c] = df[c].astype(float)
    return df[COLUMNS].reset_index(drop=True)


def _nan_rows(model: Any, ids: list[str], note: str) -> pd.DataFrame:
    nan = np.full(model.cfg.d_model, np.nan, dtype=np.float32)
    return pd.DataFrame({"item_id": ids, "step": pd.NA, "layer": pd.NA, "n_masked": pd.NA,
                         "feature": [nan] * len(ids), "note": note})


def features(model: Any, batch: Any, s: Any, shared: dict, *, score: Callable) -> pd.DataFrame:
    """The ``features`` rows of one run (``shared["out"]``, the batch's sampler run); see the module doc.
    ``score``: the accuracy probe's ``(model, batch, rendered, generated, condition) -> rows`` function."""
    out = shared["out"]
    ids = list(batch.item_ids)
    if out.causal:
        rows = _nan_rows(model, ids, "causal (ARM) model: no masked canvas to pool over")
    else:
        check_budget(model, len(ids), out.n_steps)
        try:
            pooled, n_masked, n_pooled = masked_mean_residuals(model, out)
        except SamplerConfigError as e:
            rows = _nan_rows(model, ids, f"not replayable: {e}")
        else:
            S, L, B, d = pooled.shape
            bi, si, li = np.indices((B, S, L)).reshape(3, -1)        # item-major: an item's rows are contiguous
            flat = pooled.permute(2, 0, 1, 3).reshape(-1, d).numpy()
            n, k = n_masked.numpy()[si, bi], n_pooled.numpy()[si, bi]
            rows = pd.DataFrame({"item_id": np.asarray(ids, object)[bi], "step": si, "layer": li, "n_masked": n,
                                 "feature": list(flat), "note": _note(n, k)})
    return _finish(rows.merge(_targets(model, batch, out, score), on="item_id", how="left", sort=False))
