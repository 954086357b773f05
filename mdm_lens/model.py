"""`HookedMDM`: a hooked, exact re-implementation of LLaDA / Dream (and of their autoregressive twins
Llama / Qwen2) built on TransformerLens' `HookedRootModule`, so `run_with_hooks`, `run_with_cache`,
`hooks()` and `ActivationCache` are TransformerLens' own.
"""

from __future__ import annotations

import difflib
from typing import Any, Callable, Literal, Sequence, Union

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn
from transformer_lens import ActivationCache, HookedRootModule
from transformer_lens.hook_points import HookPoint

from mdm_lens import masks, tokenization
from mdm_lens.components import Block, RMSNorm, rotary_cos_sin
from mdm_lens.config import MDMConfig
from mdm_lens.errors import HookNameError, InputError

ReturnType = Literal["logits", "aligned", "both", None]
NamesFilter = Union[None, str, Sequence[str], Callable[[str], bool]]


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
        return torch.zeros(self.weight.shape[0], dtype=self.weight.dtype, device=self.weight.device)

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_vocab"]:
        return F.linear(x, self.weight)


def shift_logits(raw: Float[Tensor, "batch pos d_vocab"]) -> Float[Tensor, "batch pos d_vocab"]:
    """Dream's alignment: the prediction for position i is read from hidden state i-1 (i ≥ 1)."""
    return torch.cat([raw[:, :1], raw[:, :-1]], dim=1)


class HookedMDM(HookedRootModule):
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
        self.embed = Embed(cfg)
        self.hook_embed = HookPoint()
        self.blocks = nn.ModuleList(Block(cfg, layer) for layer in range(cfg.n_layers))
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
                    tokenizer: Any = None) -> "HookedMDM":
        """A randomly initialised model (normal(0, init_std) matrices, unit norm weights)."""
        model = cls(cfg, tokenizer=tokenizer)
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".w"):
                    p.fill_(1.0)
                elif "bias" in name:
                    p.normal_(0.0, init_std, generator=gen)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype) * init_std)
        return model.to(cfg.device).eval()

    @classmethod
    def from_pretrained(cls, name_or_path: str, *, dtype: torch.dtype | str = torch.float32,
                        device: str | torch.device = "cpu", **kwargs: Any) -> "HookedMDM":
        """Load a real checkpoint (local folder, HF cache, or a shipped zoo model). See `mdm_lens.loading`."""
        from mdm_lens.loading import load_pretrained

        return load_pretrained(cls, name_or_path, dtype=dtype, device=device, **kwargs)

    def set_use_attn_result(self, use_attn_result: bool) -> None:
        """TL's switch for `blocks.{l}.attn.hook_result` ([batch, pos, head, d_model])."""
        self.cfg.use_attn_result = use_attn_result

    def set_tokenizer(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    # --- inputs -------------------------------------------------------------------------------------
    def _check_tokens(self, tokens: Tensor, attention_mask: Tensor | None) -> Tensor:
        if isinstance(tokens, (str, list)) and (isinstance(tokens, str) or isinstance(tokens[0], str)):
            raise InputError("forward takes token ids; use `model.to_tokens(text)` first (or `model(model.to_tokens(text))`).")
        tokens = torch.as_tensor(tokens)
        if tokens.ndim == 1:
            tokens = tokens[None]
        if tokens.ndim != 2 or tokens.dtype not in (torch.int64, torch.int32):
            raise InputError(f"tokens must be an integer tensor [batch, pos], got {tuple(tokens.shape)} {tokens.dtype}.")
        if tokens.shape[1] > self.cfg.n_ctx:
            raise InputError(f"sequence of {tokens.shape[1]} tokens exceeds the context of {self.cfg.n_ctx}; "
                             "truncate the input or shorten gen_length.")
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= self.cfg.d_vocab:
            raise InputError(f"token ids must lie in [0, {self.cfg.d_vocab}), got range [{lo}, {hi}].")
        if attention_mask is not None:
            if attention_mask.shape != tokens.shape:
                raise InputError(f"attention_mask shape {tuple(attention_mask.shape)} must equal tokens shape "
                                 f"{tuple(tokens.shape)} (1 = real token, 0 = padding).")
            mask_id = self.cfg.mask_token_id
            if mask_id is not None and bool(((attention_mask == 0) & (tokens == mask_id)).any()):
                raise InputError(f"padding uses the mask token id {mask_id}: the model would read pads as positions "
                                 "to denoise. Pad with the pad/EOS id instead (LLaDA asserts the same).")
        return tokens.to(self.embed.W_E.device)

    def positions(self, tokens: Tensor, attention_mask: Tensor | None) -> Int[Tensor, "batch pos"]:
        """Rotary positions: raw 0..T-1 (LLaDA, HF default) or Dream's count of real tokens under padding."""
        b, t = tokens.shape
        if attention_mask is not None and self.cfg.position_policy == "cumsum" and not bool(attention_mask.all()):
            pos = attention_mask.long().cumsum(-1) - 1
            return pos.masked_fill(attention_mask == 0, 1).to(tokens.device)
        return torch.arange(t, device=tokens.device).expand(b, t)

    def _rotary(self, positions: Tensor, arange: bool) -> tuple[Tensor, Tensor]:
        key = (positions.shape[1], positions.device)
        if arange and key in self._rope_cache:
            return self._rope_cache[key]
        cos, sin = rotary_cos_sin(positions[:1] if arange else positions, self.cfg.d_head, self.cfg.rope_theta)
        if arange:
            self._rope_cache[key] = (cos, sin)
        return cos, sin

    def build_mask(self, tokens: Tensor, attention_mask: Tensor | None, attn_mask: Tensor | None
                   ) -> tuple[Tensor | None, bool]:
        """The boolean visibility mask `[batch|1, 1, query, key]` (None = all visible) and the causal flag."""
        causal = self.cfg.attention == "causal"
        pad = None
        if attention_mask is not None and not bool(attention_mask.all()):
            attention_mask = attention_mask.to(tokens.device)
            pad = masks.pair_mask(attention_mask) if self.cfg.padding_mask == "pair" else masks.key_padding(attention_mask)
        if attn_mask is not None:
            attn_mask = attn_mask.to(tokens.device)
            if attn_mask.ndim == 2:
                attn_mask = attn_mask[None, None]
            if attn_mask.dtype != torch.bool or attn_mask.shape[-2:] != (tokens.shape[1], tokens.shape[1]):
                raise InputError(f"attn_mask must be bool [..., {tokens.shape[1]}, {tokens.shape[1]}] "
                                 f"(True = may attend), got {tuple(attn_mask.shape)} {attn_mask.dtype}.")
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
    ) -> Any:
        """Run the model.

        Args:
            tokens: token ids `[batch, pos]`.
            attention_mask: HF-style `[batch, pos]`, 1 = real token, 0 = padding (hidden as keys).
            attn_mask: an explicit boolean visibility mask `[query, key]` or `[batch|1, 1, query, key]`
                (e.g. `masks.block_causal`), ANDed with padding and, for causal models, the causal mask.
            position_ids: rotary positions; default from `cfg.position_policy`.
            return_type: "logits" (raw: logit i from hidden state i, TL convention), "aligned" (logit i
                predicts token i; differs from raw only for `cfg.logit_shift` models such as Dream),
                "both" (a tuple raw, aligned) or None.
        """
        tokens = self._check_tokens(tokens, attention_mask)
        if position_ids is None:
            positions = self.positions(tokens, attention_mask)
            arange = attention_mask is None or self.cfg.position_policy == "arange" or bool(attention_mask.all())
        else:
            positions, arange = torch.as_tensor(position_ids, device=tokens.device).expand_as(tokens), False
        cos, sin = self._rotary(positions, arange)
        mask, causal = self.build_mask(tokens, attention_mask, attn_mask)
        resid = self.hook_embed(self.embed(tokens))
        for block in self.blocks:
            resid = block(resid, cos, sin, mask, causal)
        if return_type is None:
            return None
        raw = self.unembed(self.ln_final(resid))
        if return_type == "logits":
            return raw
        aligned = shift_logits(raw) if self.cfg.logit_shift else raw
        if return_type == "aligned":
            return aligned
        if return_type == "both":
            return raw, aligned
        raise InputError(f"return_type must be 'logits', 'aligned', 'both' or None, got {return_type!r}.")

    def generate(self, prompt: Any, **kwargs: Any) -> Any:
        """Run the real sampler step by step (LLaDA, Dream or autoregressive); see `mdm_lens.diffusion.generate`."""
        from mdm_lens.diffusion.generate import generate

        return generate(self, prompt, **kwargs)

    def aligned_logits(self, raw: Tensor) -> Tensor:
        return shift_logits(raw) if self.cfg.logit_shift else raw

    # --- hooks: TL machinery, with a typed error for names that do not exist --------------------------
    def check_hook_name(self, name: str) -> None:
        if name not in self.hook_dict:
            close = difflib.get_close_matches(name, list(self.hook_dict), n=3, cutoff=0.6)
            hint = f" Did you mean {', '.join(close)}?" if close else ""
            raise HookNameError(
                f"no hook point named {name!r}.{hint} List them with `list(model.hook_dict)`; names follow "
                "TransformerLens, e.g. 'blocks.0.attn.hook_pattern'."
            )

    def add_hook(self, name, hook, dir="fwd", is_permanent=False, level=None, prepend=False) -> None:  # type: ignore[override]
        if isinstance(name, str):
            self.check_hook_name(name)
        super().add_hook(name, hook, dir=dir, is_permanent=is_permanent, level=level, prepend=prepend)

    def _enable_hook_with_name(self, name: str, hook: Callable, dir) -> None:  # type: ignore[override]
        self.check_hook_name(name)
        super()._enable_hook_with_name(name, hook, dir)

    def _check_names_filter(self, names_filter: NamesFilter) -> None:
        if isinstance(names_filter, str):
            self.check_hook_name(names_filter)
        elif isinstance(names_filter, (list, tuple)):
            for n in names_filter:
                self.check_hook_name(n)

    def run_with_cache(self, *model_args: Any, names_filter: NamesFilter = None, remove_batch_dim: bool = False,
                       return_cache_object: bool = True, **kwargs: Any) -> tuple[Any, ActivationCache]:
        """TL's `run_with_cache`, returning TL's `ActivationCache` (hook names are checked first)."""
        self._check_names_filter(names_filter)
        out, cache_dict = super().run_with_cache(*model_args, names_filter=names_filter,
                                                 remove_batch_dim=remove_batch_dim, **kwargs)
        if return_cache_object:
            return out, ActivationCache(cache_dict, self, has_batch_dim=not remove_batch_dim)
        return out, cache_dict

    # --- TransformerLens weight surface ---------------------------------------------------------------
    @property
    def W_E(self) -> Float[Tensor, "d_vocab d_model"]:
        return self.embed.W_E

    @property
    def W_U(self) -> Float[Tensor, "d_model d_vocab"]:
        return self.unembed.W_U

    @property
    def b_U(self) -> Float[Tensor, "d_vocab"]:
        return self.unembed.b_U

    def _stack(self, attr: str, sub: str = "attn") -> Tensor:
        return torch.stack([getattr(getattr(b, sub), attr) for b in self.blocks], dim=0)

    W_Q = property(lambda self: self._stack("W_Q"))
    W_K = property(lambda self: self._stack("W_K"))
    W_V = property(lambda self: self._stack("W_V"))
    W_O = property(lambda self: self._stack("W_O"))
    b_Q = property(lambda self: self._stack("b_Q"))
    b_K = property(lambda self: self._stack("b_K"))
    b_V = property(lambda self: self._stack("b_V"))
    b_O = property(lambda self: self._stack("b_O"))
    W_in = property(lambda self: self._stack("W_in", "mlp"))
    W_gate = property(lambda self: self._stack("W_gate", "mlp"))
    W_out = property(lambda self: self._stack("W_out", "mlp"))

    def tokens_to_residual_directions(self, tokens: Any) -> Tensor:
        """Unembedding directions `[..., d_model]` of the given tokens (TL's helper for `logit_attrs`)."""
        if isinstance(tokens, str):
            tokens = self.to_single_token(tokens)
        t = torch.as_tensor(tokens, device=self.W_U.device)
        return self.W_U[:, t].movedim(0, -1)

    def accumulated_bias(self, layer: int, mlp_input: bool = False, include_mlp_biases: bool = True) -> Tensor:
        """Sum of the output biases up to `layer`: zero, since these families have no o/down biases
        (Qwen2's value bias reaches the residual through `hook_z`, hence through the heads' results)."""
        return torch.zeros(self.cfg.d_model, dtype=self.W_E.dtype, device=self.W_E.device)

    # --- text helpers (TL names) ----------------------------------------------------------------------
    def to_tokens(self, text: str | Sequence[str], prepend_bos: bool | None = None,
                  padding_side: Literal["left", "right"] = "left", return_attention_mask: bool = False) -> Any:
        """Tokenize one text or a batch; batches are padded (left by default) with the pad id, never the mask id."""
        tok = tokenization.require(self.tokenizer)
        texts = [text] if isinstance(text, str) else list(text)
        bos = self.cfg.bos_token_id
        add_bos = (self.cfg.extra.get("prepend_bos", False) if prepend_bos is None else prepend_bos) and bos is not None
        rows = [([bos] if add_bos else []) + tokenization.encode(tok, t) for t in texts]
        pad = self.cfg.pad_token_id if self.cfg.pad_token_id is not None else self.cfg.eos_token_id
        if pad is None:
            pad = 0
        if pad == self.cfg.mask_token_id:
            raise InputError(f"the pad id equals the mask id {pad}; set cfg.pad_token_id to another token.")
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        am = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            sl = slice(width - len(r), width) if padding_side == "left" else slice(0, len(r))
            ids[i, sl] = torch.tensor(r, dtype=torch.long)
            am[i, sl] = 1
        ids = ids.to(self.W_E.device)
        return (ids, am.to(self.W_E.device)) if return_attention_mask else ids

    def to_string(self, tokens: Tensor | Sequence[int]) -> str | list[str]:
        tok = tokenization.require(self.tokenizer)
        t = torch.as_tensor(tokens)
        if t.ndim == 2:
            return [tokenization.decode(tok, row.tolist()) for row in t]
        return tokenization.decode(tok, t.tolist())

    def to_str_tokens(self, tokens: Tensor | Sequence[int] | str) -> list[str]:
        """One string per token; mask tokens are shown as `[MASK]` whatever the vocabulary calls them."""
        tok = tokenization.require(self.tokenizer)
        if isinstance(tokens, str):
            tokens = self.to_tokens(tokens)[0]
        t = torch.as_tensor(tokens)
        if t.ndim == 2:
            if t.shape[0] != 1:
                raise InputError("to_str_tokens takes one sequence; index the batch first.")
            t = t[0]
        mask_id = self.cfg.mask_token_id
        return ["[MASK]" if int(i) == mask_id else tokenization.id_to_token(tok, int(i)) for i in t]

    def to_single_token(self, string: str) -> int:
        tok = tokenization.require(self.tokenizer)
        ids = tokenization.encode(tok, string)
        if len(ids) != 1:
            raise InputError(f"{string!r} is {len(ids)} tokens, not one.")
        return ids[0]

    def __repr__(self) -> str:  # nn.Module's repr of 32 blocks is not what anyone wants to read
        c = self.cfg
        return (f"HookedMDM({c.model_name!r}, family={c.family}, attention={c.attention}, layers={c.n_layers}, "
                f"d_model={c.d_model}, heads={c.n_heads}/{c.n_key_value_heads}, d_mlp={c.d_mlp}, vocab={c.d_vocab}, "
                f"logit_shift={c.logit_shift}, dtype={str(c.dtype).removeprefix('torch.')})")
