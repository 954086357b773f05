"""`HookedMDM`: a hooked, exact re-implementation of LLaDA / Dream (and of their autoregressive twins
Llama / Qwen2) built on TransformerLens' `HookedRootModule`, so `run_with_hooks`, `run_with_cache`,
`hooks()` and `ActivationCache` are TransformerLens' own.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from mdm_lens import inputs, loss, masks, tokenization, validate
from mdm_lens.components import RMSNorm, rotary_cos_sin
from mdm_lens.config import MDMConfig
from mdm_lens.hook_surface import CheckedHookSurface, NamesFilter
from mdm_lens.init import from_config_args, realistic_
from mdm_lens.loading.placement import execution_device
from mdm_lens.qk_attention import make_block
from mdm_lens.module_list import IndexedModules
from mdm_lens.precision import compute_dtype
from mdm_lens.rotary import scaled_rotary_cos_sin  # noqa: F401  (re-exported: it lived here)
from mdm_lens.errors import HookNameError, InputError, InputTypeError, OutOfRangeError
from mdm_lens.offload_checks import guard_views
from mdm_lens.readonly import ReadOnlyView, read_only

ReturnType = Literal["logits", "aligned", "raw_and_aligned", "loss", "both", None]
RETURN_TYPES = ("logits", "aligned", "raw_and_aligned", "loss", "both", None)


class Embed(nn.Module):
    def __init__(self, cfg: MDMConfig):
        super().__init__()
        self.W_E = nn.Parameter(torch.empty(cfg.d_vocab, cfg.d_model, dtype=cfg.dtype))

    def forward(self, tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch pos d_model"]:
        return F.embedding(tokens, self.W_E)


class Unembed(nn.Module):
    """Stored in the `[d_vocab, d_model]` layout of the checkpoints; `W_U` is TL's `[d_model, d_vocab]` view."""

    def __init__(self, cfg: MDMConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.d_vocab, cfg.d_model, dtype=cfg.dtype))

    @property
    def W_U(self) -> Float[Tensor, "d_model d_vocab"]:
        return self.weight.T

    @property
    def b_U(self) -> Float[Tensor, "d_vocab"]:
        return read_only(torch.zeros(self.weight.shape[0], dtype=self.weight.dtype, device=self.weight.device),
                         "these families have no unembedding bias; the zeros are not a parameter.")

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_vocab"]:
        return F.linear(x, self.weight)


def shift_logits(raw: Float[Tensor, "batch pos d_vocab"]) -> Float[Tensor, "batch pos d_vocab"]:
    """Dream's alignment: the prediction for position i is read from hidden state i-1 (i ≥ 1)."""
    return torch.cat([raw[:, :1], raw[:, :-1]], dim=1)


def _id_like(tokens: Any) -> bool:
    """An int, a tensor, or (nested) lists / tuples of ints: what `torch.as_tensor` can turn into token ids."""
    if isinstance(tokens, (list, tuple)):
        return all(_id_like(t) for t in tokens)
    return isinstance(tokens, (int, Tensor))


def _circuits() -> Any:
    from mdm_lens import circuits_tl  # imported on use: it pulls TL's FactoredMatrix utilities

    return circuits_tl


#: `HookedMDM.forward`'s keywords (an unknown one is a typed error naming the nearest)
FORWARD_KEYWORDS = ("tokens", "attention_mask", "attn_mask", "position_ids", "return_type", "block_length",
                    "targets", "loss_per_token", "weighting", "p_mask")
#: TransformerLens forward options with no counterpart here, named so the error says why
TL_FORWARD_ONLY = {k: "It is a TransformerLens forward option mdm_lens does not implement: run the whole model and "
                      "read (or hook) blocks.{l}.hook_resid_pre instead." for k in ("stop_at_layer", "start_at_layer")}
TL_FORWARD_ONLY.update({k: "It is a TransformerLens forward option mdm_lens does not implement (token ids only; "
                           "use model.to_tokens for text)." for k in ("prepend_bos", "padding_side", "tokens_to_return")})

class HookedMDM(tokenization.TokenizerMethods, CheckedHookSurface):
    """A masked diffusion LM (bidirectional) or its autoregressive twin (causal) with TL hook points.

    Hook points (TransformerLens names and axis order): `hook_embed`, `blocks.{l}.hook_resid_pre`,
    `blocks.{l}.ln1.hook_scale/hook_normalized`, `blocks.{l}.attn.hook_q/hook_k/hook_v`
    `[batch, pos, head, d_head]`, `attn.hook_rot_q/hook_rot_k`, `attn.hook_attn_scores` and
    `attn.hook_pattern` `[batch, head, query, key]`, `attn.hook_z`, `attn.hook_result` (opt-in),
    `hook_attn_out`, `hook_resid_mid`, `ln2.*`, `mlp.hook_pre/hook_pre_linear/hook_post`,
    `hook_mlp_out`, `hook_resid_post`, `ln_final.hook_scale/hook_normalized`.
    """

    def __init__(self, cfg: MDMConfig, tokenizer: Any = None):
        super().__init__()
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.chat_template: Any = None  # mdm_lens.chat.ChatTemplate, read from the checkpoint's tokenizer files
        self.embed = Embed(cfg)
        self.hook_embed = HookPoint()
        self.blocks = IndexedModules((make_block(cfg, layer) for layer in range(cfg.n_layers)), "layer")
        self.ln_final = RMSNorm(cfg)
        self.unembed = Unembed(cfg)
        if cfg.tie_word_embeddings:
            self.unembed.weight = self.embed.W_E
        self._rope_cache: dict[tuple, tuple[Tensor, Tensor]] = {}
        self.state: Any = None  # the sampler's DenoisingState while a denoising step runs
        self.setup()

    # --- construction -------------------------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg: MDMConfig, seed: int | None = 0, init_std: float = 0.02,
                    tokenizer: Any = None, init: Literal["normal", "realistic"] = "realistic") -> "HookedMDM":
        """A randomly initialised model: normal(0, init_std) matrices, with norm weights and biases drawn to look
        trained (`init="realistic"`, the default, `mdm_lens.init.realistic_`: norm weights log-normal around 1,
        biases and router biases non-zero, so a dropped norm weight or bias changes the output), or unit norm
        weights and normal(0, init_std) biases (`init="normal"`, for planted cases that need unit norms)."""
        cfg, init, init_std = from_config_args(cfg, init, init_std)  # the model's own copy of cfg
        model = cls(cfg, tokenizer=tokenizer)
        gen = None if seed is None else torch.Generator().manual_seed(validate.seed(seed, min=None))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".w"):
                    p.fill_(1.0)
                elif "bias" in name:
                    p.normal_(0.0, init_std, generator=gen)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype) * init_std)
        if init == "realistic":
            realistic_(model, seed=seed or 0, bias_std=max(init_std, 0.1))
        return model.to(cfg.device).eval()

    @classmethod
    def from_pretrained(cls, name_or_path: str, *, dtype: torch.dtype | str = torch.float32,
                        device: str | torch.device | None = None, fold_ln: bool = False, center_unembed: bool = False,
                        fold_value_biases: bool = False, **kwargs: Any) -> "HookedMDM":
        """Load a real checkpoint (local folder, HF cache, or a shipped zoo model). See `mdm_lens.loading`.

        Unprocessed by default (exact to the checkpoint, unlike TL's default); `fold_ln`, `center_unembed`,
        `fold_value_biases` apply TL's weight processing after loading (`process_weights_`)."""
        from mdm_lens.loading import load_pretrained
        from mdm_lens.loading.options import check_pretrained_kwargs, processing_flags

        check_pretrained_kwargs(kwargs, "from_pretrained")
        flags = processing_flags(fold_ln, center_unembed, fold_value_biases)  # before loading: fail fast
        model = load_pretrained(cls, name_or_path, dtype=dtype, device=device, processing=flags, **kwargs)
        if any(flags.values()):
            model.process_weights_(**flags)
        return model

    @classmethod
    def from_pretrained_no_processing(cls, name_or_path: str, **kwargs: Any) -> "HookedMDM":
        """TL's name for loading without weight processing (here the same as `from_pretrained`'s default). As in
        TransformerLens, the processing flags only default to False there: an explicit `fold_ln=True` is honoured."""
        from mdm_lens.loading.options import check_pretrained_kwargs

        check_pretrained_kwargs(kwargs, "from_pretrained_no_processing")
        return cls.from_pretrained(name_or_path, **kwargs)

    def process_weights_(self, fold_ln: bool = True, center_unembed: bool = True,
                         fold_value_biases: bool = True, **unknown: Any) -> "HookedMDM":
        """TL's weight processing in place, logits kept (see `mdm_lens.processing` for what each step changes,
        which hook values change meaning, and what is refused). Any other keyword (TL's `center_writing_weights`,
        a typo such as `fold_layernorm`) is an `ArgumentError` naming the nearest accepted one."""
        from mdm_lens.loading.options import PROCESSING_FLAGS, check_pretrained_kwargs
        from mdm_lens.processing import process_weights_

        check_pretrained_kwargs(unknown, "process_weights_", accepted=PROCESSING_FLAGS)

        return process_weights_(self, fold_ln, center_unembed, fold_value_biases)

    def untie_embeddings_(self) -> "HookedMDM":
        """Give a tied unembedding its own copy, so it can be folded or centred without changing `W_E`."""
        from mdm_lens.processing import untie_embeddings_

        return untie_embeddings_(self)

    def set_use_attn_result(self, use_attn_result: bool) -> None:
        """TL's switch for `blocks.{l}.attn.hook_result` ([batch, pos, head, d_model]); hooking that name while
        it is off is an error (the hook would never fire)."""
        self.cfg.use_attn_result = validate.boolean(use_attn_result, name="use_attn_result")

    # --- inputs -------------------------------------------------------------------------------------
    def positions(self, tokens: Tensor, attention_mask: Tensor | None) -> Int[Tensor, "batch pos"]:
        """Rotary positions: raw 0..T-1 (LLaDA, HF default) or Dream's count of real tokens under padding."""
        b, t = tokens.shape
        if attention_mask is not None and self.cfg.position_policy == "cumsum" and not bool(attention_mask.all()):
            pos = attention_mask.long().cumsum(-1) - 1
            return pos.masked_fill(attention_mask == 0, 1).to(tokens.device)
        return torch.arange(t, device=tokens.device).expand(b, t)

    def _rotary(self, positions: Tensor, arange: bool) -> tuple[Tensor, Tensor]:
        scaling = self.cfg.extra.get("rope_scaling")
        dim = int(self.cfg.extra.get("rotary_dim") or self.cfg.d_head)  # partial rotary: the first `dim` dims
        # keyed on the rotary settings too, so an edit of cfg.rope_theta / rope_scaling takes effect at once
        # tables in float64 for a float64 model (the weights' dtype, which `.to` may have changed), else fp32
        dtype = compute_dtype(self.embed.W_E.dtype)
        key = (positions.shape[1], positions.device, self.cfg.rope_theta, dim, repr(scaling), dtype)
        if arange and key in self._rope_cache:
            return self._rope_cache[key]
        rows = positions[:1] if arange else positions
        if scaling:
            cos, sin = scaled_rotary_cos_sin(rows, dim, self.cfg.rope_theta, scaling, dtype)
        else:
            cos, sin = rotary_cos_sin(rows, dim, self.cfg.rope_theta, dtype)
        if arange:
            self._rope_cache[key] = (cos, sin)
        return cos, sin

    def build_mask(self, tokens: Tensor, attention_mask: Tensor | None, attn_mask: Tensor | None,
                   block_length: int | None = None) -> tuple[Tensor | None, bool]:
        """The boolean visibility mask `[batch|1, 1, query, key]` (None = all visible) and the causal flag."""
        causal = self.cfg.attention == "causal"
        pad = None
        if attention_mask is not None and not bool(attention_mask.all()):
            attention_mask = attention_mask.to(tokens.device)
            pad = masks.pair_mask(attention_mask) if self.cfg.padding_mask == "pair" else masks.key_padding(attention_mask)
        attn_mask = inputs.explicit_mask(attn_mask, tokens)
        # block diffusion: blocks aligned at position 0 (masks.block_causal); one block spanning every row is no
        # restriction, so no mask is built (a KV-cached forward over one block then attends to the cached keys too)
        if block_length is not None and block_length < tokens.shape[1]:
            attn_mask = masks.combine(attn_mask, masks.block_causal(tokens.shape[1], block_length,
                                                                    device=tokens.device))
        if pad is None and attn_mask is None:
            return None, causal
        combined = masks.combine(pad, attn_mask, masks.causal(tokens.shape[1], tokens.device) if causal else None)
        return combined, causal

    # --- forward ------------------------------------------------------------------------------------
    def forward(
        self,
        tokens: Int[Tensor, "batch pos"],
        attention_mask: Int[Tensor, "batch pos"] | None = None,
        *,
        attn_mask: Tensor | None = None,
        position_ids: Int[Tensor, "batch pos"] | None = None,
        return_type: ReturnType = "logits",
        block_length: int | None = None,
        targets: Int[Tensor, "batch pos"] | None = None,
        loss_per_token: bool = False,
        weighting: loss.Weighting = "none",
        p_mask: float | Tensor | None = None,
        **unknown: Any,
    ) -> Any:
        """Run the model.

        Args:
            tokens: token ids `[batch, pos]` (or `[pos]`), integer dtype, in `[0, d_vocab)`.
            attention_mask: HF-style `[batch, pos]`, 1 = real token, 0 = padding (hidden as keys; Dream
                also hides pad queries). Right padding gives each real position the logits it has alone;
                left padding follows the family's reference (LLaDA keeps absolute positions, Dream counts
                real tokens). A row of zeros is an error; leading pad ids without a mask get a warning.
            attn_mask: an explicit boolean visibility mask `[query, key]` or `[batch|1, 1, query, key]`
                (e.g. `masks.block_causal`), ANDed with padding and, for causal models, the causal mask; on a
                block-causal model it replaces the default block mask (pass `block_length=` too to AND both).
            position_ids: rotary positions `[batch|1, pos]`; default from `cfg.position_policy`.
            return_type: "logits" (raw: logit i from hidden state i, TL convention), "aligned" (logit i
                predicts token i; differs from raw only for `cfg.logit_shift` models such as Dream),
                "raw_and_aligned" (a tuple raw, aligned), "loss" (the training objective, `mdm_lens.loss`),
                "both" (TL's tuple: raw logits, loss) or None.
            block_length: block-causal attention (block diffusion: SDAR, LLaDA2): blocks of this length
                aligned at position 0, each query sees its own block and every earlier one. None = the
                family default `cfg.extra["block_length"]` (none with `attn_mask`, or in other families); a
                length ≥ the sequence length is full bidirectional attention.
            targets, loss_per_token, weighting, p_mask: the loss's arguments (return_type "loss"/"both" only;
                see `mdm_lens.loss`): an MDM scores the clean `targets` at the input's mask-token positions
                (`weighting="1/t"`: LLaDA's pre-training weighting by 1/p_mask); an ARM twin gives TL's
                next-token loss (`targets` default to the tokens). `loss_per_token=True`: `[batch, pos]` (MDM)
                or `[batch, pos-1]` (ARM), NaN where a position is not scored.
        """
        validate.keywords(unknown, FORWARD_KEYWORDS, where="forward", notes=TL_FORWARD_ONLY)
        return_type = validate.choice(return_type, RETURN_TYPES, name="return_type", error=InputError)
        tokens = inputs.token_ids(tokens, self.cfg, self.input_device)
        # a sampler's forward of rows past position 0 (a block against its cache) starts at a generated token, which
        # may be the pad id: the left-pad heuristic reads user input, not those windows
        inner = self.state is not None and (self.state.rows.start > 0 or
                                            int(self.state.extra.get("query_start", 0) or 0) > 0)
        attention_mask = inputs.attention_mask(attention_mask, tokens, self.cfg, warn_pads=not inner)
        wanted = loss.request(return_type, self.cfg, tokens, attention_mask, targets, loss_per_token, weighting, p_mask)
        if position_ids is None:
            positions = self.positions(tokens, attention_mask)
            arange = attention_mask is None or self.cfg.position_policy == "arange" or bool(attention_mask.all())
        else:
            positions, arange = inputs.position_ids(position_ids, tokens), False
        cos, sin = self._rotary(positions, arange)
        if block_length is not None and self.cfg.attention == "causal":  # ANDed with causal it changes nothing
            raise InputError(f"block_length={block_length!r} has no effect on a causal model ({self.cfg.model_name}): "
                             "every query already sees only earlier keys. Drop it.", argument="block_length",
                             value=block_length, allowed="None on a causal model")
        if block_length is None and attn_mask is None:  # an explicit attn_mask is the whole mask asked for
            block_length = inputs.default_block_length(self.cfg)
        if block_length is not None:
            block_length = validate.integer(block_length, name="block_length", min=1, error=InputError)
        mask, causal = self.build_mask(tokens, attention_mask, attn_mask, block_length)
        resid = self.hook_embed(self.embed(tokens))
        for block in self.blocks:
            resid = block(resid, cos, sin, mask, causal)
        if return_type is None:
            return None
        raw = self.unembed(self.ln_final(resid))
        if wanted is not None:
            value = wanted.compute(raw, self.aligned_logits(raw))
            return value if return_type == "loss" else (raw, value)
        if return_type == "logits":
            return raw
        aligned = shift_logits(raw) if self.cfg.logit_shift else raw
        return aligned if return_type == "aligned" else (raw, aligned)

    def generate(self, prompt: Any, **kwargs: Any) -> Any:
        """Run the real sampler step by step (LLaDA, Dream or autoregressive); see `mdm_lens.diffusion.generate`."""
        from mdm_lens.diffusion.generate import generate

        return generate(self, prompt, **kwargs)

    def memory_plan(self, prompt: Any = None, sampler: str = "auto", **kwargs: Any) -> Any:
        """Per-device bytes of `generate(prompt, **kwargs)` before running it (`mdm_lens.hooks.plan`); `.check()`
        refuses a run that exceeds a budget, with the table."""
        from mdm_lens.diffusion.generate import default_sampler
        from mdm_lens.diffusion.memory_guard import memory_plan

        name = default_sampler(self) if sampler == "auto" else sampler
        return memory_plan(self, prompt, sampler=name, **kwargs)

    def aligned_logits(self, raw: Tensor) -> Tensor:
        return shift_logits(raw) if self.cfg.logit_shift else raw

    # --- hooks: TL machinery, with typed errors for names that do not exist or never fire -------------
    def check_hook_name(self, name: str) -> None:
        super().check_hook_name(name)
        if name.endswith("attn.hook_result") and not self.cfg.use_attn_result:
            raise HookNameError(
                f"{name!r} never fires while per-head results are off (they cost batch·pos·head·d_model memory, so "
                "they are opt-in, as in TransformerLens): call `model.set_use_attn_result(True)` first."
            )

    def get_caching_hooks(self, names_filter: NamesFilter = None, *args: Any, **kwargs: Any) -> Any:
        """TL's caching hooks; a filter that is not an explicit list (None, a predicate) skips `hook_result`
        while it is off, as TL's cache simply lacks it (explicit names were checked and raise)."""
        if not self.cfg.use_attn_result and (names_filter is None or callable(names_filter)):
            base = names_filter

            def names_filter(name: str) -> bool:  # noqa: F811
                return not name.endswith("attn.hook_result") and (base is None or bool(base(name)))
        return super().get_caching_hooks(names_filter, *args, **kwargs)

    # --- TransformerLens weight surface ---------------------------------------------------------------
    @property
    def W_E(self) -> Float[Tensor, "d_vocab d_model"]:
        return self.embed.W_E

    @property
    def input_device(self) -> torch.device:
        """Where token ids go: the embedding's execution device (under a device_map with offloading its weight
        sits on meta; `mdm_lens.loading.placement`)."""
        return execution_device(self.embed, lambda: self.embed.W_E.device)

    @property
    def W_U(self) -> Float[Tensor, "d_model d_vocab"]:
        return self.unembed.W_U

    @property
    def b_U(self) -> Float[Tensor, "d_vocab"]:
        return self.unembed.b_U

    def _stack(self, attr: str, sub: str = "attn") -> Tensor:
        """`[n_layers, ...]` stack of a per-layer view. The layers are separate parameters, so the stack is a copy:
        it is read-only (a write raises `ReadOnlyViewError`); `blocks[l].{sub}.{attr}` writes through."""
        views = [getattr(getattr(b, sub), attr) for b in self.blocks]
        stacked = torch.stack(views, dim=0)
        # a layer's own view that is no parameter (a bias the checkpoint lacks) says why; pointing there would
        # send the user to a second refusal
        lacking = next((v.reason for v in views if isinstance(v, ReadOnlyView)), None)
        if lacking is not None:
            return read_only(stacked, f"model.{attr}: {lacking}")
        return read_only(stacked, f"model.{attr} stacks the layers into a new tensor; edit "
                                  f"model.blocks[layer].{sub}.{attr} (a view of the parameter) instead.")

    W_Q = property(lambda self: self._stack("W_Q"))
    W_K = property(lambda self: self._stack("W_K"))
    W_V = property(lambda self: self._stack("W_V"))
    W_O = property(lambda self: self._stack("W_O"))
    b_Q = property(lambda self: self._stack("b_Q"))
    b_K = property(lambda self: self._stack("b_K"))
    b_V = property(lambda self: self._stack("b_V"))
    b_O = property(lambda self: self._stack("b_O"))
    W_in, W_gate, W_out, b_in, b_out = (property(lambda self, a=a: self._stack(a, "mlp"))
                                        for a in ("W_in", "W_gate", "W_out", "b_in", "b_out"))

    OV = property(lambda self: _circuits().ov_circuit(self), doc="TL FactoredMatrix W_V W_O [layer, head, d, d]")
    QK = property(lambda self: _circuits().qk_circuit(self), doc="TL FactoredMatrix W_Q W_Kᵀ, before rotary")

    def all_composition_scores(self, mode: Literal["Q", "K", "V"]) -> Tensor:
        """TL's composition scores `[layer, head, layer, head]` (NaN where the left head is not earlier); see
        `mdm_lens.circuits_tl` for where they are meaningful (rotary, norm folding)."""
        return _circuits().all_composition_scores(self, mode)

    def tokens_to_residual_directions(self, tokens: Any) -> Float[Tensor, "... d_model"]:
        """The residual directions `[..., d_model]` whose dot product with `resid / ln_final.scale` is each token's
        logit (TL's helper for `cache.logit_attrs`): the unembedding column times the final norm's weight while it
        is not folded (TL folds it by default; without it, attributions would not sum to the logits)."""
        if isinstance(tokens, str):
            tokens = self.to_single_token(tokens)
        if not _id_like(tokens):  # first: a list of non-ids is named as such, not as a ragged list
            raise InputTypeError(f"tokens={validate.describe(tokens)} is invalid: expected an int, a str, or an "
                                 "integer tensor / list of ids.", argument="tokens", value=tokens,
                                 allowed="int, str, or an integer tensor / list of ids")
        tokens = validate.id_tensor(tokens, name="tokens")  # ragged or empty lists of ids: typed, and said so
        t = torch.as_tensor(tokens, device=self.W_U.device)
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise InputTypeError(f"tokens has dtype {t.dtype}: expected integer token ids.", argument="tokens",
                                 value=tokens, allowed="int, str, or an integer tensor / list of ids")
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.cfg.d_vocab):
            raise OutOfRangeError(f"tokens holds ids outside [0, d_vocab={self.cfg.d_vocab}).", argument="tokens",
                                  value=tokens, allowed=f"ids in [0, {self.cfg.d_vocab})")
        directions = self.W_U[:, t].movedim(0, -1)
        return self.ln_final.apply_weight(directions)

    def accumulated_bias(self, layer: int, mlp_input: bool = False, include_mlp_biases: bool = True) -> Tensor:
        """TL's sum of the biases written to the residual stream before `layer` (`mlp_input`: also the attention
        output bias of `layer` itself): the attention output biases `b_O` (LLaDA2 / LLaDA-MoE `o_bias`, or made by
        `fold_value_biases`). The gated MLPs have no output bias, so `include_mlp_biases` changes nothing; an
        unfolded value bias reaches the residual through `hook_z`, hence through the heads' results."""
        layer = validate.integer(layer, name="layer", min=0, max=self.cfg.n_layers)
        if mlp_input and layer == self.cfg.n_layers:
            raise OutOfRangeError(f"mlp_input=True needs a layer < n_layers={self.cfg.n_layers}, got {layer}.",
                                  argument="layer", value=layer, allowed=f"0..{self.cfg.n_layers - 1}")
        out = torch.zeros(self.cfg.d_model, dtype=self.W_E.dtype, device=self.W_E.device)
        for block in self.blocks[: layer + (1 if mlp_input else 0)]:
            out = out + block.attn.b_O
        return out

    def __repr__(self) -> str:  # nn.Module's repr of 32 blocks is not what anyone wants to read
        c = self.cfg
        return (f"HookedMDM({c.model_name!r}, family={c.family}, attention={c.attention_label}, layers={c.n_layers}, "
                f"d_model={c.d_model}, heads={c.n_heads}/{c.n_key_value_heads}, d_mlp={c.d_mlp}, vocab={c.d_vocab}, "
                f"logit_shift={c.logit_shift}, dtype={str(c.dtype).removeprefix('torch.')})")


# TL weight surface on an offloaded embed / unembed / final norm: a typed error naming it (mdm_lens.offload_checks)
guard_views(Unembed, ["W_U", "b_U"])
guard_views(HookedMDM, ["W_E", "accumulated_bias"], part="embed")
guard_views(HookedMDM, ["tokens_to_residual_directions"], part="ln_final")
