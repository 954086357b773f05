"""Views: static figures (`figures`), interactive circuitsvis views that also render offline (`circuits`)
and a portable HTML report (`report`).

    from mdm_lens import views
    views.absorption_by_layer({"tiny-mdm": (mean, std)}, {"tiny-mdm": 2.0}, "Absorption", path="abs.png")
    views.attention(out, step=0, layer=0)               # inline in Jupyter
    views.explore(out, model)                           # the step explorer (inline, or .save("x.html"))
    views.write_report("report/", "Run 1", [views.Section("Absorption", "…", images=["abs.png"])], meta={})
"""

from mdm_lens.views.circuits import (attention, attention_from_pattern, bundle_available, offline,
                                     step_str_tokens, to_html, tokens_by_persistence)
from mdm_lens.views.explore import Explorer, explore, step_mapping
from mdm_lens.views.figures import (absorption_by_layer, accuracy_curves, knockout_effect, model_family,
                                    qk_decomposition_bars, qk_maps, region_flow, retrieval_heatmap,
                                    series_styles, temporal_heatmap)
from mdm_lens.views.report import Section, markdown_lite, write_report

__all__ = ["absorption_by_layer", "temporal_heatmap", "qk_maps", "qk_decomposition_bars", "retrieval_heatmap",
           "region_flow", "knockout_effect", "accuracy_curves", "model_family", "series_styles",
           "attention", "attention_from_pattern", "tokens_by_persistence", "step_str_tokens", "to_html", "offline",
           "bundle_available", "Section", "write_report", "markdown_lite", "explore", "Explorer", "step_mapping"]
