"""Hooks on transformers-native models (DiffusionGemma, Llama, Qwen2, …) with TransformerLens names;
see `mdm_lens.bridge.model`. Needs `transformers>=5.11` (`pip install mdm-lens[bridge]`); imported
lazily so that `mdm_lens` itself does not need transformers."""

from __future__ import annotations

from typing import Any

__all__ = ["HOOKED_ATTENTION", "TransformersBridge", "hooked_attention_forward", "register"]


def __getattr__(name: str) -> Any:
    if name == "TransformersBridge":
        from mdm_lens.bridge.model import TransformersBridge

        return TransformersBridge
    if name in ("HOOKED_ATTENTION", "hooked_attention_forward", "register"):
        from mdm_lens.bridge import attention

        return getattr(attention, name)
    raise AttributeError(f"module 'mdm_lens.bridge' has no attribute {name!r}")
