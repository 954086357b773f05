"""Every `architectures` / `model_type` name `from_pretrained` dispatches on, read from the loaders' own tables
(bridge, DDiT research families, the 2026 families, Fast-dLLM v2, LLaDA, the transformers-style families), so the
unknown-architecture message lists exactly what loads and cannot drift when a family is added."""

from __future__ import annotations

NATIVE_MODEL_TYPE = "mdm_lens"  # mdm_lens' own save_pretrained format


def dispatched() -> tuple[dict[str, str], dict[str, str]]:
    """({architecture: family}, {model_type: family}) of every name a checkpoint's config.json may carry."""
    # imported here: the bridge and ddit loaders import this package's modules at their top
    from mdm_lens.bridge.loading import BRIDGED
    from mdm_lens.bridge.loading import MODEL_TYPES as BRIDGE_TYPES
    from mdm_lens.bridge.spec import FAMILY as BRIDGE_FAMILY
    from mdm_lens.ddit.loading import RESEARCH_ARCHITECTURES, RESEARCH_MODEL_TYPES
    from mdm_lens.loading import families, fastdllm_v2, hf, llada

    archs = {**{a: BRIDGE_FAMILY[a] for a in BRIDGED}, **RESEARCH_ARCHITECTURES, **families.ARCHITECTURES,
             fastdllm_v2.ARCHITECTURE: fastdllm_v2.FAMILY, llada.ARCHITECTURE: "llada", **hf.FAMILIES}
    types = {**{t: BRIDGE_FAMILY[a] for t, a in BRIDGE_TYPES.items()}, **RESEARCH_MODEL_TYPES,
             **families.MODEL_TYPES, fastdllm_v2.MODEL_TYPE: fastdllm_v2.FAMILY, llada.MODEL_TYPE: "llada",
             **hf.MODEL_TYPES, NATIVE_MODEL_TYPE: NATIVE_MODEL_TYPE}
    return archs, types


def supported_names() -> str:
    """The names for an error message: every architecture, then every model_type."""
    archs, types = dispatched()
    return (f"architectures {', '.join(sorted(archs, key=str.lower))}; or model_type "
            f"{', '.join(sorted(types, key=str.lower))}")
