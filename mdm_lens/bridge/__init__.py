"""Hooks on transformers-native models (DiffusionGemma, Llama, Qwen2, …) with TransformerLens names;
see `mdm_lens.bridge.model`."""

from mdm_lens.bridge.attention import HOOKED_ATTENTION, hooked_attention_forward, register
from mdm_lens.bridge.model import TransformersBridge

__all__ = ["HOOKED_ATTENTION", "TransformersBridge", "hooked_attention_forward", "register"]
