"""What the bridge needs to know about a transformers model: where its layers, embeddings and norms
are, which layer style they follow, and an `MDMConfig` summary (`model.cfg`) for the parts of
mdm_lens that read one (reducers, memory estimates, probes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from mdm_lens.config import MDMConfig
from mdm_lens.errors import ConfigError

# causal-LM classes whose decoder layers are Llama-shaped (pre-norm attention + gated MLP)
LLAMA_STYLE = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM")
FAMILY = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral",
          "Qwen3ForCausalLM": "qwen3", "DiffusionGemmaForBlockDiffusion": "diffusion_gemma"}


@dataclass
class Spec:
    style: str  # "gemma" | "llama"
    cfg: MDMConfig
    decoder_layers: Any
    decoder_embed: nn.Module
    decoder_norm: nn.Module
    encoder_layers: Any = None
    encoder_embed: nn.Module | None = None
    encoder_norm: nn.Module | None = None
    self_conditioning: nn.Module | None = None
    moe: bool = False
    n_experts: int = 0  # routed experts per MoE layer (the range a hook's expert ids are checked against)


def _diffusion_gemma(model: nn.Module) -> Spec:
    tc = model.config.text_config
    layers = model.model.decoder.layers
    head_dims = [l.self_attn.head_dim for l in layers]
    kv_heads = [l.self_attn.k_proj.out_features // l.self_attn.head_dim for l in layers]
    cfg = MDMConfig(
        d_model=tc.hidden_size, n_layers=tc.num_hidden_layers, n_heads=tc.num_attention_heads,
        d_mlp=tc.intermediate_size, d_vocab=tc.vocab_size, n_kv_heads=max(kv_heads), d_head=max(head_dims),
        n_ctx=tc.max_position_embeddings, norm_eps=tc.rms_norm_eps, attention="bidirectional",
        bos_token_id=tc.bos_token_id, eos_token_id=_first(tc.eos_token_id), pad_token_id=tc.pad_token_id,
        tie_word_embeddings=True, family="diffusion_gemma", model_name=_name(model),
        dtype=next(model.parameters()).dtype, act_fn=tc.hidden_activation,
        extra={"layer_types": list(tc.layer_types), "head_dims": head_dims, "kv_heads": kv_heads,
               "canvas_length": model.config.canvas_length, "sliding_window": tc.sliding_window,
               "final_logit_softcapping": tc.final_logit_softcapping, "eos_token_ids": _all(tc.eos_token_id),
               "uniform_noise": True},
    )
    enc = model.model.encoder.language_model
    return Spec("gemma", cfg, layers, model.model.decoder.embed_tokens, model.model.decoder.norm,
                encoder_layers=enc.layers, encoder_embed=enc.embed_tokens, encoder_norm=enc.norm,
                self_conditioning=model.model.decoder.self_conditioning, moe=True,
                n_experts=int(getattr(tc, "num_experts", None) or 0))


def _causal_lm(model: nn.Module, cls: str) -> Spec:
    c = model.config
    layers = model.model.layers
    causal = getattr(c, "is_causal", True) is not False
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    cfg = MDMConfig(
        d_model=c.hidden_size, n_layers=c.num_hidden_layers, n_heads=c.num_attention_heads, d_mlp=c.intermediate_size,
        d_vocab=c.vocab_size, n_kv_heads=c.num_key_value_heads, d_head=head_dim,
        n_ctx=c.max_position_embeddings, rope_theta=float((c.rope_parameters or {}).get("rope_theta", 1e4)),
        norm_eps=c.rms_norm_eps, qkv_bias=bool(getattr(layers[0].self_attn.q_proj, "bias", None) is not None),
        attention="causal" if causal else "bidirectional", bos_token_id=c.bos_token_id,
        eos_token_id=_first(c.eos_token_id), pad_token_id=c.pad_token_id,
        tie_word_embeddings=bool(c.tie_word_embeddings), family=FAMILY[cls], model_name=_name(model),
        dtype=next(model.parameters()).dtype,
    )
    return Spec("llama", cfg, layers, model.model.embed_tokens, model.model.norm)


def describe(model: nn.Module) -> Spec:
    cls = type(model).__name__
    if cls == "DiffusionGemmaForBlockDiffusion":
        return _diffusion_gemma(model)
    if cls in LLAMA_STYLE:
        return _causal_lm(model, cls)
    raise ConfigError(f"the bridge supports DiffusionGemmaForBlockDiffusion and {', '.join(LLAMA_STYLE)}; got {cls}. "
                      "Other transformers families need their layer style added to mdm_lens.bridge.layers.")


def _name(model: nn.Module) -> str:
    return str(getattr(model.config, "_name_or_path", "") or type(model).__name__)


def _first(eos: Any) -> int | None:
    return eos[0] if isinstance(eos, (list, tuple)) and eos else eos


def _all(eos: Any) -> list[int]:
    return list(eos) if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos])
