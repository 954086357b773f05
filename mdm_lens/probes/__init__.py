"""Probes: tensor-level metrics over attention patterns, received attention and q/k/v vectors.

- :mod:`floating` — received attention, anchor (floating token / sink) detection, absorption with
  uniform nulls, drift across denoising steps, fixed-sink vs floating labels (spec §3.1–§3.5);
- :mod:`qk` — exact norm/angle (Shapley) split of an anchor key's QK advantage (§3.6);
- :mod:`flow` — regions, token-level rollout, pooled region flow and its diagnostics (§3.8);
- :mod:`run` — adapters from model runs / ``GenerateOutput`` to the tensor probes;
- :mod:`retrieval` — retrieval-head scores for diffusion unmasking and ARMs, head masking (§3.7);
- :mod:`patching` — attention knockout and activation patching of anchors (§2.8–2.10);
- :mod:`cache_effect` — what an approximate KV cache changes (cached vs fresh forwards, per step and layer);
- :mod:`router` — MoE routing per step and layer: router entropy, expert load by position class, anchors vs rest;
- :mod:`noise_level` — DDiT models: anchor attention share and adaLN gates over the noise level σ (or t) × layer.

Every result is a dataclass with ``.to_frame()`` (tidy long-format DataFrame).
"""

from . import flow, floating, patching, qk, retrieval, run
from .cache_effect import CacheEffect, cache_effect
from .router import RouterStats, router_stats
from .noise_level import NoiseLevelResult, noise_level, plot_noise_level
from ._results import ResultMixin
from .patching import KnockoutResult, PatchingResult, knockout, patch_anchor_activations
from .retrieval import (AblationResult, RetrievalItem, RetrievalScores, ablation_accuracy, from_qa_item, mask_heads,
                        retrieval_scores)
from .run import (AbsorptionByLayer, absorption_by_layer, anchors_over_steps, drift_from_output, final_attention,
                  flow_for_items, qk_at_layer, regions_for_item)

__all__ = ["floating", "qk", "flow", "run", "retrieval", "patching", "ResultMixin",
           "final_attention", "absorption_by_layer", "AbsorptionByLayer", "anchors_over_steps", "drift_from_output",
           "qk_at_layer", "regions_for_item", "flow_for_items",
           "RetrievalItem", "from_qa_item", "retrieval_scores", "RetrievalScores", "mask_heads", "ablation_accuracy",
           "AblationResult", "knockout", "KnockoutResult", "patch_anchor_activations", "PatchingResult",
           "cache_effect", "CacheEffect", "router_stats", "RouterStats", "noise_level", "NoiseLevelResult",
           "plot_noise_level"]
