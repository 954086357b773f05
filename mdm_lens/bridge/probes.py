"""Probes on DiffusionGemma runs, where the decoder's queries (the canvas) are a suffix of its keys
(prompt, earlier canvases, the canvas) and nothing is masked.

Which probes apply, and over which queries and keys:

* the run's records — `ReceivedAttention` (query sets "all", "masked" = **not yet accepted** at that
  step, "committed" = **accepted** at that step, "generated" = the canvas), `TopKKeys` (query rows at the
  canvas's absolute positions), `probes.run.anchors_over_steps`, `drift_from_output` (temporal floating) —
  run unchanged; keys that do not exist yet at a step are NaN in the records;
* `qk_at_step` (here): the QK split from a `TrajectoryCache` step;
* the whole-sequence probes — `absorption_by_layer`, `qk_at_layer`, `final_attention`, `flow_for_items`
  and `retrieval_scores` — run on the forward of `mdm_lens.bridge.sequence` (prompt → encoder, answer →
  decoder canvas, the sampler's masks), with `prompt_length=` where they take token ids: Q = the answer
  rows (the decoder's queries), keys = what each decoder layer lets them see (prompt + answer; a sliding
  layer only the last window − 1 prompt keys), which also sets the uniform nulls. A clean forward has no
  not-yet-accepted rows, so `query="masked"` is refused there;
* `knockout` runs its sampled metrics (`mdm_lens.probes.knockout_bd`: canvas queries, anchors on a pre-pass
  of the step's own decoder call, gold scores from the softcapped logits); its teacher-forced metrics are NaN
  (no masked canvas to place the gold in). `patch_anchor_activations` raises `InputError` saying why.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mdm_lens import validate
from mdm_lens.errors import InputError
from mdm_lens.probes import floating, qk

def qk_at_step(out: Any, step: int, layer: int, anchor: Any = None, rows: Tensor | None = None,
               share: float = 0.8) -> qk.QKDecomposition:
    """§3.6 norm/angle split of the anchor key's QK advantage at one decoder layer of one denoising step.

    Needs `out.cache` to hold `blocks.{layer}.attn.hook_rot_q`, `hook_rot_k`, `hook_v` and `hook_pattern`
    at `step` (e.g. `cache=["blocks.3.attn.hook_rot_q", ...] @ steps(0, 5)`). Queries are the canvas rows;
    keys every position that exists at that step; `anchor` None = the key receiving the most head-mean
    attention from the canvas rows. `rows`: a `[batch, canvas]` bool mask of the query rows to use (default
    all; e.g. the step's not-yet-accepted rows, `~accepted_before`). The canvas queries are placed at their absolute positions (the rows before
    them are empty and excluded), so `qk.decompose` runs unchanged.
    """
    if out.cache is None:
        raise InputError("qk_at_step reads a trajectory cache: generate with cache=[... hook_rot_q, hook_rot_k, "
                         "hook_v, hook_pattern] @ steps(...).")
    step = validate.index(step, out.n_steps, name="step", what="denoising steps")
    pre = f"blocks.{layer}.attn."
    names = [pre + n for n in ("hook_rot_q", "hook_rot_k", "hook_v", "hook_pattern")]
    missing = [n for n in names if n not in out.cache.names]
    if missing or step not in out.cache.steps:
        raise InputError(f"qk_at_step needs {names} cached at step {step}; cached names {out.cache.names}, "
                         f"steps {out.cache.steps}.")
    c = out.cache[step]
    q, k, v, pattern = (c[n].double() for n in names)
    batch, canvas = q.shape[:2]
    n_keys = k.shape[1]
    q_full = torch.cat([q.new_zeros(batch, n_keys - canvas, *q.shape[2:]), q], dim=1)
    query_mask = torch.zeros(batch, n_keys, dtype=torch.bool)
    if rows is None:
        rows = torch.ones(batch, canvas, dtype=torch.bool)
    validate.tensor(rows, name="rows", shape=(batch, canvas), dtype="bool")
    query_mask[:, n_keys - canvas:] = rows.cpu()
    # A sliding-window layer reads only the prefix keys its cache kept; the bridge left-pads the dropped ones
    # with exact zero keys (see mdm_lens.bridge.attention), which a real post-norm, post-RoPE key never is.
    key_visible = k.abs().sum((-1, -2)) > 0                                 # [batch, key]
    if anchor is None:
        received = floating.received_attention(pattern.mean(1), query_mask=rows.cpu())  # [batch, key]
        anchor = received.masked_fill(~key_visible, -1.0).argmax(-1)
    return qk.decompose(q_full, k, anchor, query_mask=query_mask, key_visible=key_visible, v=v, share=share)
