"""Config facts of the DDiT families: how an `MDMConfig` describes one, and the keys each hub config class reads
with its class defaults (a key absent from config.json takes that default, as `from_pretrained` of the reference
class would)."""

from __future__ import annotations

from typing import Any

import torch

from mdm_lens.config import MDMConfig
from mdm_lens.errors import ConfigError

DDIT_FAMILIES = ("mdlm", "duo")

# hub `MDLMConfig.__init__` defaults (families-2.md §2.2, verbatim class). cond_dim 129 is the class default; the
# released mdlm-owt config.json says 128 — a tiny config without the key must get 129, like the reference.
MDLM_DEFAULTS: dict[str, Any] = dict(vocab_size=50258, model_length=1024, hidden_dim=768, cond_dim=129, n_blocks=12,
                                     n_heads=12, dropout=0.1, time_conditioning=False)
# hub `DUOConfig` (families-2.md §4.1: the exact defaults are unconfirmed [U]); the research `model=small` values
# and GPT-2 + [PAD] = 50258 ids. `causal` selects the AR baseline, which is not a diffusion model (refused).
DUO_DEFAULTS: dict[str, Any] = dict(vocab_size=50258, model_length=1024, hidden_dim=768, cond_dim=128, n_blocks=12,
                                    n_heads=12, dropout=0.1, causal=False)
DEFAULTS = {"mdlm": MDLM_DEFAULTS, "duo": DUO_DEFAULTS}


def ddit_config(family: str, *, d_vocab: int, n_ctx: int, d_model: int, cond_dim: int, n_layers: int, n_heads: int,
                time_conditioning: bool, model_name: str = "custom", dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu", **extra: Any) -> MDMConfig:
    """An `MDMConfig` for a DDiT model. MDLM's mask id is the last vocabulary entry (`tokenizer.vocab_size` of
    GPT-2 = vocab_size − 1); Duo is uniform-state and has none. `extra` carries cond_dim, time_conditioning and
    the output parameterisation ("subs" for MDLM, "log_softmax" for Duo)."""
    mask = d_vocab - 1 if family == "mdlm" else None
    facts = dict(cond_dim=cond_dim, time_conditioning=bool(time_conditioning), uniform_state=family == "duo",
                 parameterization="subs" if family == "mdlm" else "log_softmax", gen_length=min(n_ctx, 32), **extra)
    # BD3LM's forward runs its block-causal mask (blocks of block_size from position 0): the probes read the mask a
    # clean forward ran under from `attention` / `extra["block_length"]`, as for the other block-causal families
    block_causal = family == "bd3lm" and "block_size" in extra
    if block_causal:
        facts["block_length"] = extra["block_size"]
    return MDMConfig(d_model=d_model, n_layers=n_layers, n_heads=n_heads, d_mlp=4 * d_model, d_vocab=d_vocab,
                     n_ctx=n_ctx, rope_theta=10000.0, norm_eps=1e-5,
                     attention="block_causal" if block_causal else "bidirectional",
                     mask_token_id=mask, family=family, model_name=model_name, dtype=dtype, device=device,
                     extra=facts, normalization_type="LN", act_fn="gelu_new")


def check_mask_key(raw: dict[str, Any], cfg: MDMConfig, path: Any) -> None:
    """The DiT references take the mask id from the tokenizer (MDLM / BD3LM: GPT-2's vocab_size, the last row;
    GIDD: [MASK] appended last), never from config.json. A `mask_token_id` there that names another id (or no id)
    would be silently overruled: refused, naming the id the model uses. Duo is uniform-state and has no mask."""
    if raw.get("mask_token_id") is None:
        return
    value, mask = raw["mask_token_id"], cfg.mask_token_id
    if isinstance(value, bool) or not isinstance(value, int) or value != mask:
        uses = (f"the last vocabulary id, vocab_size - 1 = {mask}" if mask is not None
                else f"none: {cfg.family} is uniform-state, with no mask token")
        raise ConfigError(f"{path}: mask_token_id={value!r} is not the mask id this {cfg.family} model uses ({uses}; "
                          "its reference reads the tokenizer, not config.json); remove the key or give that id.")
