"""TransformerLens weight processing for `HookedMDM`: `fold_ln`, `center_unembed`, `fold_value_biases`.

The default model is unprocessed (exact to the checkpoint). `model.process_weights_(...)` rewrites the weights
so the forward computes the same logits while the weights say more directly what reaches the residual stream:

- `fold_ln`: each RMSNorm's weight `w` is multiplied into the columns of every matrix that reads the norm's
  output (ln1 → the fused q/k/v weight; ln2 → gate/up, or an MoE layer's router, routed experts and shared
  expert; ln_final → the unembedding). The norm becomes weight-free (`w = None`, `cfg.normalization_type =
  "RMSPre"`). Biases are unchanged: an RMSNorm has none. The per-head q/k norms (`attn.q_norm`/`k_norm`) keep
  their weights: rotary follows them, not a linear map, so there is nothing to fold them into.
- `center_unembed`: subtract from each row of `W_U` (over the vocabulary) its mean. Logits change by one
  constant per position, so softmax, argmax and every sampler are unchanged; raw logit values are not.
- `fold_value_biases`: the value bias reaches the output as `b_V @ W_O` at every query whose attention row sums
  to 1, so it moves into the output bias `b_O` (a parameter is made where there was none; under GQA each query
  head uses the bias of its key/value head). After it, `hook_v`, `hook_z` and `hook_result` no longer contain
  the value bias (as in TL); `hook_attn_out` is unchanged. Query rows that see no key at all (a padding row
  under Dream's "pair" padding) then carry `b_O` where they carried 0; such rows are never read.

Folding runs in fp32 and casts back: a processed fp32 model equals the unprocessed one up to fp32 rounding
(~1e-6 relative); a processed bf16 model only within bf16 rounding of the folded weights (not token-exact).
Refused, with the reason: folding `ln_final` into or centering a tied unembedding (it would change the
embedding too; `untie_embeddings_()` first), value-bias folding under `clip_qkv` (the clamp sits between the
bias and the attention), and the transformers-native bridge (its modules are transformers' own). `cfg` follows
the processing (`normalization_type = "RMSPre"`, `extra["o_bias"]` once an output bias is made), so `cfg.n_params`
still equals the parameter count; `save_pretrained` refuses a processed model (its layout does not reload).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import Tensor, nn

from mdm_lens import validate
from mdm_lens.errors import ConfigError
from mdm_lens.offload_checks import require_resident


def process_weights_(model: Any, fold_ln: bool = True, center_unembed: bool = True,
                     fold_value_biases: bool = True) -> Any:
    """Apply the chosen processing in place (checks first, so a refusal leaves the model untouched)."""
    fold_ln = validate.boolean(fold_ln, name="fold_ln")
    center_unembed = validate.boolean(center_unembed, name="center_unembed")
    fold_value_biases = validate.boolean(fold_value_biases, name="fold_value_biases")
    if fold_ln or center_unembed or fold_value_biases:  # a fold would skip the offloaded (meta) weights
        require_resident(model, "process_weights_ (fold_ln / center_unembed / fold_value_biases)")
    _check(model, fold_ln, center_unembed, fold_value_biases)
    with torch.no_grad():
        if fold_ln:
            fold_layer_norm_(model)
        if center_unembed:
            center_unembed_(model)
        if fold_value_biases:
            fold_value_biases_(model)
    done = getattr(model, "weight_processing", {})
    model.weight_processing = {k: bool(done.get(k)) or v for k, v in
                               (("fold_ln", fold_ln), ("center_unembed", center_unembed),
                                ("fold_value_biases", fold_value_biases))}
    return model


def _check(model: Any, fold_ln: bool, center_unembed: bool, fold_value_biases: bool) -> None:
    tied = model.unembed.weight is model.embed.W_E
    if tied and (center_unembed or (fold_ln and model.ln_final.w is not None)):
        what = "fold ln_final into" if fold_ln else "center"
        raise ConfigError(f"cannot {what} the unembedding of {model.cfg.model_name!r}: it is tied to the embedding "
                          "(tie_word_embeddings=True), so the embedding would change too. Call "
                          "`model.untie_embeddings_()` first (the unembedding becomes a copy), or pass "
                          "fold_ln=False, center_unembed=False.")
    if fold_value_biases and model.cfg.extra.get("clip_qkv") is not None and model.cfg.qkv_bias:
        raise ConfigError("fold_value_biases is not exact under clip_qkv: v is clamped after its bias, so the bias "
                          "cannot move past the clamp into b_O. Pass fold_value_biases=False.")


def untie_embeddings_(model: Any) -> Any:
    """Give the unembedding its own parameter (a copy of the tied embedding) and set
    `cfg.tie_word_embeddings = False`; the logits are unchanged. Needed before folding into `W_U`."""
    if model.unembed.weight is model.embed.W_E:
        require_resident(model, "untie_embeddings_")  # a copy of an offloaded (meta) embedding holds no values
        model.unembed.weight = nn.Parameter(model.embed.W_E.detach().clone())
        model.cfg.tie_word_embeddings = False
    return model


def _fold_into(norm: nn.Module, weights: list[Tensor]) -> None:
    """Multiply `norm.w` into the input columns of each `[out, d_model]` weight (in fp32), then drop it."""
    if norm.w is None:
        return
    w = norm.w.detach().float()
    for weight in weights:
        weight.copy_((weight.float() * w).to(weight.dtype))
    norm.w = None


def _mlp_readers(mlp: nn.Module) -> Iterator[Tensor]:
    """Every `[out, d_model]` weight that reads ln2's output: a dense MLP's gate/up, or an MoE layer's router,
    routed experts and shared expert (`mdm_lens.moe.MoEMLP`)."""
    if hasattr(mlp, "experts"):
        yield mlp.router_weight
        for expert in mlp.experts:
            yield expert.gate_up_weight
        if mlp.shared_expert is not None:
            yield mlp.shared_expert.gate_up_weight
    else:
        yield mlp.gate_up_weight


def fold_layer_norm_(model: Any) -> None:
    for block in model.blocks:
        _fold_into(block.ln1, [block.attn.qkv_weight])
        _fold_into(block.ln2, list(_mlp_readers(block.mlp)))
    _fold_into(model.ln_final, [model.unembed.weight])
    model.cfg.normalization_type = "RMSPre"


def center_unembed_(model: Any) -> None:
    """`W_U -= W_U.mean(over vocab)`: stored `[d_vocab, d_model]`, so the mean runs over dim 0."""
    u = model.unembed.weight
    u32 = u.float()
    u.copy_((u32 - u32.mean(dim=0, keepdim=True)).to(u.dtype))


def fold_value_biases_(model: Any) -> None:
    for block in model.blocks:
        attn = block.attn
        if attn.qkv_bias is None:
            continue
        b_v = attn._b_V.float().repeat_interleave(attn.repeat_kv_heads, dim=0)  # [head, d_head]
        shift = torch.einsum("he,hed->d", b_v, attn.W_O.float())
        if attn.o_bias is None:
            attn.o_bias = nn.Parameter(torch.zeros_like(attn.o_weight[:, 0]))
            model.cfg.extra["o_bias"] = True  # cfg describes the parameters the model now has (cfg.n_params)
        attn.o_bias.copy_((attn.o_bias.float() + shift).to(attn.o_bias.dtype))
        attn._split(attn.qkv_bias)[2].zero_()
