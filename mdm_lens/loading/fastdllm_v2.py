"""Fast-dLLM v2 (`Fast_dLLM_QwenForCausalLM`, `model_type: Fast_dLLM_Qwen`) → HookedMDM.

Fast-dLLM v2 is Qwen2.5 fine-tuned for block diffusion: the Qwen2 weights and key names (`model.embed_tokens`,
`model.layers.{i}.self_attn.{q,k,v}_proj` with biases, `o_proj` without, SiLU-gated MLP, `model.norm`, `lm_head`),
read here by the Qwen2 loader (`mdm_lens.loading.hf`). What differs is the attention at inference, transcribed from
the reference `modeling.py` (`Fast_dLLM_QwenModel.eval_mask`): query position q sees key position k iff
`q // block_size >= k // block_size` (blocks aligned at absolute position 0, bidirectional inside a block), with
`block_size` given by the sampler (the checkpoint's `bd_size`, default 32). That is `model(tokens, block_length=B)`,
the block-causal mask of SDAR / LLaDA2, with `cfg.extra["block_length"] = bd_size` as its default. Logits are
token-shifted like Dream's (`cfg.logit_shift`: the logit at i predicts token i+1). The plain RoPE of the eval
branch is used (the split-half rotation of the reference's training branch never runs at inference).

The mask id: config.json `mask_token_id`, else the tokenizer files' `mask_token` or a token named `|<MASK>|`
(the released vocabulary's), else the reference constant 151665 when the vocabulary holds it. The pad id (the
sampler writes `tokenizer.pad_token_id` after a stop token): config.json's, else the tokenizer's `pad_token`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mdm_lens.config import MDMConfig
from mdm_lens.errors import ConfigError

ARCHITECTURE, MODEL_TYPE, FAMILY = "Fast_dLLM_QwenForCausalLM", "Fast_dLLM_Qwen", "fastdllm_v2"
BD_SIZE = 32  # Fast_dLLM_QwenConfig.bd_size default (and the eval harness' bd_size)
MASK_ID, STOP_TOKEN = 151665, 151645  # generation_functions.py FAST_DLLM_MASK_ID / FAST_DLLM_STOP_TOKEN
MASK_NAME = "|<MASK>|"


def is_fastdllm_v2(config: dict[str, Any]) -> bool:
    return ARCHITECTURE in (config.get("architectures") or []) or config.get("model_type") == MODEL_TYPE


def config_from_fastdllm_v2(config: dict[str, Any], name: str, folder: Path) -> MDMConfig:
    from mdm_lens.loading.family_parts import mask_token_id
    from mdm_lens.loading.hf import config_from_hf
    from mdm_lens.loading.special import TokenTable, _read_json, _token_name
    from mdm_lens.loading.values import FASTDLLM_V2_SCHEMA, check_raw

    check_raw(config, FASTDLLM_V2_SCHEMA, folder / "config.json")  # also checked by read_config; kept for direct calls
    cfg = config_from_hf(config, "qwen2", name)  # Qwen2Config defaults for absent keys, sliding window refused
    bd_size = config.get("bd_size", BD_SIZE)
    if not isinstance(bd_size, int) or isinstance(bd_size, bool) or bd_size <= 0:
        raise ConfigError(f"config.json has bd_size={bd_size!r}; Fast-dLLM v2 needs a positive block size.")
    cfg.family, cfg.attention, cfg.logit_shift = FAMILY, "block_causal", True
    cfg.extra["block_length"] = bd_size
    mask = mask_token_id(config, folder, cfg.d_vocab)
    if mask is None:
        mask = TokenTable(folder).get(MASK_NAME)
    if mask is None and MASK_ID < cfg.d_vocab:
        mask = MASK_ID
    cfg.mask_token_id = mask
    if cfg.pad_token_id is None:
        pad = TokenTable(folder).get(_token_name(_read_json(folder / "tokenizer_config.json").get("pad_token")))
        cfg.pad_token_id = pad if pad is not None and 0 <= pad < cfg.d_vocab else None
    return cfg
