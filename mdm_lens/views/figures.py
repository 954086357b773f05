"""Static figures (matplotlib) mirroring the Attention-Floating paper's plots, plus the ablations we add.

Every function takes plain arrays (numpy, torch or lists) and labels, never probe dataclasses, builds a
`matplotlib.figure.Figure` directly (no `pyplot`: no global figure registry, no GUI backend, nothing
shown; safe in scripts, tests and notebooks, where a returned figure displays inline) and, when `path`
is given, saves it as a PNG (130 dpi, tight bounding box; parent folders are created).

Colours are colour-blind safe (Okabe & Ito) and consistent across figures: masked diffusion models
are blues (LLaDA/the first MDM = #0072B2, the next = #56B4E9, ...), autoregressive models are oranges
(Llama/the first ARM = #E69F00, the next = #D55E00, ...). A series is recognised as MDM or ARM from its
name (see `model_family`); qualifiers such as "no context" / "closed-book" keep the colour and switch
to a dashed line.

    absorption_by_layer      §1.b  absorption % by layer, ±1 std bands, uniform nulls, excess panel
    temporal_heatmap         §1.g  steps × positions received attention, anchors hatched, commit frontier
    qk_maps                  §1.c  raw QK / cos / ‖q‖‖k‖ maps with anchor columns marked (▲)
    qk_decomposition_bars    §3.6  per-head norm term N and angle term G of the anchor's QK advantage Δ
    retrieval_heatmap        §1.d  layers × heads retrieval scores, threshold outlines, per-layer means
    region_flow              §1.e  region-level flow rows (e.g. Answer row for gold at first/middle/last)
    knockout_effect          anchor vs random knockout effect per layer/condition
    accuracy_curves          accuracy vs #distractors / gold position, MDM vs ARM, with/without context

The code lives in `figstyle` (palette, style, helpers), `fig_attention` and `fig_results`; this module
re-exports it so `from mdm_lens.views.figures import X` keeps working.
"""

from __future__ import annotations

from mdm_lens.views.fig_attention import absorption_by_layer, qk_decomposition_bars, qk_maps, temporal_heatmap
from mdm_lens.views.fig_results import accuracy_curves, knockout_effect, region_flow, retrieval_heatmap
from mdm_lens.views.figstyle import (ANCHOR_COLOR, ANGLE_COLOR, ARM_COLORS, DPI, KNOCK_COLOR, MDM_COLORS,  # noqa: F401
                                     NORM_COLOR, OTHER_COLORS, RANDOM_COLOR, STYLE, LensFigure, model_family, save,
                                     series_styles)

__all__ = ["absorption_by_layer", "temporal_heatmap", "qk_maps", "qk_decomposition_bars", "retrieval_heatmap",
           "region_flow", "knockout_effect", "accuracy_curves", "model_family", "series_styles", "save",
           "MDM_COLORS", "ARM_COLORS", "OTHER_COLORS", "STYLE"]
