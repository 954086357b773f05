"""One clean forward of a whole sequence on a block-diffusion model (DiffusionGemma), framed for the probes.

LLaDA/Dream probes run one forward over prompt + answer and read `[batch, head, T, T]` patterns. DiffusionGemma
has no such forward: the prompt goes through the causal encoder (writing the KV cache) and the answer is the
decoder's canvas, attending bidirectionally to the cached prompt and to itself. `sequence_forward` runs exactly
the sampler's first-canvas pass on `tokens = prompt + answer` (`prompt_length` splits them): encoder over the
prompt, the sampler's decoder mask (left padding hidden, the sliding window over the cached prompt), the
decoder over the answer with self-conditioning off (the first step's condition), and returns:

* `cache`: the requested hooks; decoder attention hooks framed on the whole sequence — `hook_pattern`
  `[batch, head, T, T]` and `hook_rot_q` `[batch, T, head, d]` hold the decoder's rows at the answer positions
  and zeros at the prompt rows, which are no decoder queries; key hooks already index absolute positions;
* `query_rows` `[batch, T]`: the decoder's queries (the answer positions) — the query set Q of every probe;
* `key_visible` `{layer: [batch, T]}`: the keys each decoder layer lets the answer see, read off the scores the
  mask set to the dtype's minimum (the same for every answer row and head: checked), so uniform nulls count
  exactly the visible keys (a sliding layer sees only the last `window - 1` prompt keys);
* `encoder_patterns` `{layer: [batch, head, P, P]}` when asked: the prompt rows' own (causal) attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from jaxtyping import Bool, Int
from torch import Tensor

from mdm_lens import validate
from mdm_lens.errors import ArgumentError

__all__ = ["SequenceForward", "sequence_forward", "split_point"]


@dataclass
class SequenceForward:
    cache: dict[str, Tensor]
    query_rows: Bool[Tensor, "batch pos"]
    key_visible: dict[int, Bool[Tensor, "batch pos"]]
    prompt_length: int
    encoder_patterns: dict[int, Tensor] = field(default_factory=dict)


def split_point(model: Any, tokens: Tensor, prompt_length: Any) -> int:
    """The checked prompt/answer split of a `[batch, T]` sequence (at least one token on each side)."""
    if prompt_length is None:
        raise ArgumentError(f"{model.cfg.model_name} is a block-diffusion model: the prompt goes through the encoder and "
                            "the answer is the decoder's canvas, so this probe needs prompt_length= (the number of "
                            "prompt tokens in tokens; the rest is the answer).", argument="prompt_length", value=None,
                            allowed=f"an int in [1, {tokens.shape[1] - 1}]")
    return validate.integer(prompt_length, name="prompt_length", min=1, max=tokens.shape[1] - 1)


def _frame_rows(x: Tensor, P: int, axis: int) -> Tensor:
    """Zero rows for the prompt positions before the decoder's rows along `axis` (query axis)."""
    shape = list(x.shape)
    shape[axis] = P
    return torch.cat([x.new_zeros(shape), x], dim=axis)


def _collect(model: Any, names: Sequence[str], fwd_hooks: Sequence[Any], run: Any) -> dict[str, Tensor]:
    """Run `run()` with TL caching hooks on `names` (and `fwd_hooks`); hooks removed even if it raises."""
    for n in names:
        model.check_hook_name(n)
    wanted = set(names)
    store, caching, _ = model.get_caching_hooks(names_filter=lambda n: n in wanted)
    with model.hooks(fwd_hooks=list(fwd_hooks) + caching):  # the cache sees what the given hooks made
        run()
    return store


@torch.no_grad()
def sequence_forward(model: Any, tokens: Int[Tensor, "batch pos"], prompt_length: int,
                     attention_mask: Tensor | None = None, layers: Sequence[int] = (),
                     hooks: Sequence[str] = ("hook_pattern",), encoder_patterns: bool = False,
                     fwd_hooks: Sequence[Any] = ()) -> SequenceForward:
    """See the module docstring. `hooks`: attention hook names (`hook_pattern`, `hook_rot_q`, `hook_rot_k`,
    `hook_v`, …) cached for each decoder layer in `layers`; `fwd_hooks` run during the decoder pass."""
    from transformers import DynamicCache

    if not getattr(model, "is_block_diffusion", False):
        raise ArgumentError("sequence_forward splits a sequence into encoder prompt and decoder canvas: it needs a "
                            "block-diffusion model (DiffusionGemma through the bridge).", argument="model",
                            value=type(model).__name__, allowed="a block-diffusion TransformersBridge")
    validate.tensor(tokens, name="tokens", ndim=2, dtype="int")
    if attention_mask is not None:
        validate.tensor(attention_mask, name="attention_mask", shape=tuple(tokens.shape))
    P = split_point(model, tokens, prompt_length)
    layers = validate.indices(list(layers), model.cfg.n_layers, name="layers", what="decoder layer")
    hf = model.hf
    batch, T = tokens.shape
    prompt, answer = tokens[:, :P], tokens[:, P:]
    C = answer.shape[1]
    full = torch.ones_like(tokens, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    am = full[:, :P]
    cache = DynamicCache(config=hf.config.get_text_config(decoder=True))
    enc_pos = torch.arange(0, P, dtype=torch.int32, device=tokens.device)[None]
    new_ids, enc_masks = hf._prepare_encoder_inputs(input_ids=prompt, attention_mask=am, encoder_position_ids=enc_pos,
                                                    cache=cache, is_prefill=True, canvas_length=C, batch_size=batch)
    enc_names = [f"encoder.{l}.attn.hook_pattern" for l in layers] if encoder_patterns else []
    enc_cache = _collect(model, enc_names, (), lambda: model.encode(new_ids, cache, attention_mask=enc_masks,
                                                                    position_ids=enc_pos))
    dec_am = full  # the sampler's decoder mask: the prompt's padding, then the canvas (right padding hidden too)
    mask = hf.model.decoder.create_diffusion_decoder_attention_mask(config=hf.config, inputs_embeds=answer.unsqueeze(-1),
                                                                    cache=cache, decoder_attention_mask=dec_am)
    dec_pos = torch.arange(P, P + C, dtype=torch.int32, device=tokens.device)[None]
    names = [f"blocks.{l}.attn.{h}" for l in layers for h in dict.fromkeys(tuple(hooks) + ("hook_attn_scores",))]
    dec = _collect(model, names, fwd_hooks, lambda: model(decoder_input_ids=answer, cache=cache,
                                                          decoder_attention_mask=mask, decoder_position_ids=dec_pos))
    out: dict[str, Tensor] = {}
    visible: dict[int, Tensor] = {}
    for l in layers:
        pre = f"blocks.{l}.attn."
        scores = dec[pre + "hook_attn_scores"]
        seen = scores > torch.finfo(scores.dtype).min / 2                            # [batch, head, C, T]
        if not bool((seen == seen[:, :1, :1]).all()):  # the probes' nulls assume one key set per series
            raise ArgumentError(f"decoder layer {l} lets different answer rows or heads see different keys; the "
                                "sequence probes need one key set per row of the batch.", argument="layers", value=l)
        visible[l] = seen[:, 0, 0]
        for h in hooks:
            v = dec[pre + h]
            if h in ("hook_pattern", "hook_attn_scores"):
                v = _frame_rows(v, P, axis=2)
            elif h in ("hook_rot_q", "hook_q", "hook_z"):
                v = _frame_rows(v, P, axis=1)
            out[pre + h] = v
    rows = full.clone()
    rows[:, :P] = False
    enc = {l: enc_cache[f"encoder.{l}.attn.hook_pattern"] for l in layers} if enc_names else {}
    return SequenceForward(out, rows, visible, P, enc)
