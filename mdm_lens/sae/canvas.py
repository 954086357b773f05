"""`MaskedCanvas`: a view of a HookedMDM whose forward sees what the MDM saw in training -- a canvas with
masked tokens (LLaDA's forward process) -- so SAELens' `ActivationsStore` / `LanguageModelSAETrainingRunner`
(`override_model=`) collect the activations a diffusion LM actually computes, not those of a clean text
it never sees at inference."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from mdm_lens import validate
from mdm_lens.errors import ArgumentError, ArgumentTypeError, InputError

EPS = 1e-3  # LLaDA's minimum masking probability (as mdm_lens.zoo.train.EPS)
POSITIONS = ("masked", "unmasked", "all")



def not_pad(cfg: Any, tokens: Tensor) -> Tensor:
    """Positions that are not the pad id (all of them for a model without one: `tokens != None` would be the
    Python bool True, not a mask)."""
    return torch.ones_like(tokens, dtype=torch.bool) if cfg.pad_token_id is None else tokens != cfg.pad_token_id


def maskable_positions(cfg: Any, tokens: Tensor) -> Tensor:
    """The positions the forward process may mask: not pad, not a leading <bos> (training never masked it)."""
    keep = not_pad(cfg, tokens)
    if cfg.bos_token_id is not None:
        keep[:, 0] &= tokens[:, 0] != cfg.bos_token_id
    return keep

class MaskedCanvas:
    """A model view for SAELens.

    Args:
        model: a HookedMDM (bidirectional; a causal ARM twin is refused: it is never trained on masks).
        mask_rate: None (LLaDA's forward process: per sequence t ~ U(0, 1), p = (1 - eps) t + eps, each
            maskable token masked with prob p -- the zoo's "continuous" schedule), a float in (0, 1] (every
            token masked with that prob), or a callable `(batch, generator) -> Tensor[batch]` of per-row rates.
        positions: which positions' activations `run_with_cache` returns: "masked", "unmasked" or "all".
            "masked"/"unmasked" gather the chosen positions of the whole batch into one row `[1, n, d]`
            (SAELens flattens batch and position, so only the set of rows matters); attention patterns / scores
            `[batch, head, query, key]` give the chosen query rows, `[1, n, head, key]`; a hook without leading
            `[batch, pos]` axes is refused naming it.
        seed: the masking noise; each call draws the next masks from one generator, so a run is reproducible.

    Position 0 (`<bos>`) and padding are never masked, as in training (`mdm_lens.zoo.train.mdm_masks`).
    """

    def __init__(self, model: Any, mask_rate: float | Callable | None = None, positions: str = "masked",
                 seed: int = 0, eps: float = EPS):
        cfg = getattr(model, "cfg", None)
        if cfg is None or not hasattr(model, "run_with_cache"):
            raise ArgumentTypeError(f"model={validate.describe(model)} is not a HookedMDM.", argument="model",
                                    value=model, allowed="a HookedMDM")
        if getattr(cfg, "attention", "bidirectional") == "causal":
            raise InputError("MaskedCanvas needs a masked diffusion model; this one is causal (an ARM never sees "
                             "masked canvases).", argument="model", value=cfg.model_name, allowed="a bidirectional MDM")
        if cfg.mask_token_id is None:
            raise InputError(f"MaskedCanvas draws the masking forward process, and {cfg.model_name!r} has no mask "
                             "token (uniform-state noise: Duo): no canvas of this model is a masked one.",
                             argument="model", value=cfg.model_name, allowed="a model with a mask token")
        if getattr(cfg, "extra", {}).get("time_conditioning"):
            raise InputError(f"MaskedCanvas runs the canvas without a noise level, and {cfg.model_name!r} is "
                             "conditioned on it (time_conditioning): its forward would read the masked canvas at the "
                             "clean time. Record its activations along generate runs instead "
                             "(mdm_lens.sae.export_activations), where each step has its own sigma.",
                             argument="model", value=cfg.model_name, allowed="a model without time conditioning")
        if mask_rate is not None and not callable(mask_rate):
            mask_rate = validate.number(mask_rate, name="mask_rate", min=0.0, max=1.0, min_open=True)
        self.model = model
        self.mask_rate = mask_rate
        self.positions = validate.choice(positions, POSITIONS, name="positions")
        self.seed = validate.seed(seed, min=None)
        self.eps = validate.number(eps, name="eps", min=0.0, max=1.0)
        if mask_rate is not None and self.eps != EPS:  # eps shapes LLaDA's t ~ U(0, 1) rate only
            raise ArgumentError(f"eps={eps!r} has no effect with mask_rate={validate.describe(mask_rate)}: eps enters "
                                "LLaDA's rate p = (1 - eps) t + eps, used only with mask_rate=None.", argument="eps",
                                value=eps, allowed=f"the default {EPS} unless mask_rate=None")
        self.generator = torch.Generator().manual_seed(self.seed)
        self.last_masked: Tensor | None = None  # the mask of the last forward, [batch, pos] (for inspection)

    # --- what SAELens reads off its model ----------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        # cfg, tokenizer, to_tokens, to_string, W_E, hook_dict, ... are the model's (only called for
        # attributes not set in __init__, so no recursion on self.model)
        if name == "model":
            raise AttributeError(name)
        return getattr(self.model, name)

    def rates(self, batch: int) -> Tensor:
        """Per-row masking probabilities `[batch]`."""
        if self.mask_rate is None:
            t = torch.rand(batch, generator=self.generator)
            return (1 - self.eps) * t + self.eps
        if callable(self.mask_rate):
            r = torch.as_tensor(self.mask_rate(batch, self.generator), dtype=torch.float32)
            validate.tensor(r, name="mask_rate(batch, generator)", ndim=1, finite=True)
            if r.shape[0] != batch or bool(((r <= 0) | (r > 1)).any()):
                raise InputError(f"mask_rate returned {validate.describe(r)}; expected {batch} rates in (0, 1].",
                                 argument="mask_rate", value=r, allowed=f"a tensor of {batch} rates in (0, 1]")
            return r
        return torch.full((batch,), float(self.mask_rate))

    def mask(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """(noisy tokens, masked `[batch, pos]` bool): the forward process on a clean batch."""
        cfg = self.model.cfg
        tokens = validate.tensor(torch.as_tensor(tokens), name="tokens", ndim=(1, 2), dtype="int")
        if tokens.ndim == 1:
            tokens = tokens[None]
        if int(tokens.min()) < 0 or int(tokens.max()) >= cfg.d_vocab:
            raise InputError(f"tokens hold ids outside [0, {cfg.d_vocab}).", argument="tokens",
                             value=validate.describe(tokens), allowed=f"ids in [0, {cfg.d_vocab})")
        n_mask = int((tokens == cfg.mask_token_id).sum())
        if n_mask:  # a mask already in the input would be a target the model never predicts, and not counted
            raise InputError(f"tokens hold the mask id {cfg.mask_token_id} at {n_mask} position(s); the forward "
                             "process masks clean sequences: pass the clean tokens.", argument="tokens",
                             value=validate.describe(tokens), allowed=f"ids other than {cfg.mask_token_id}")
        maskable = maskable_positions(cfg, tokens)
        p = self.rates(tokens.shape[0])
        draw = torch.rand(tokens.shape, generator=self.generator)
        masked = (draw < p[:, None]) & maskable.cpu()
        masked = masked.to(tokens.device)
        return tokens.masked_fill(masked, cfg.mask_token_id), masked

    def _select(self, act: Tensor, masked: Tensor, name: str = "logits") -> Tensor:
        if self.positions == "all" or self._per_sequence(name):
            return act  # a conditioning hook (DDiT's hook_sigma, adaLN terms) has no position to select: kept whole
        keep = (masked if self.positions == "masked" else ~masked).to(act.device)
        if name.endswith(("hook_pattern", "hook_attn_scores")) and act.ndim == 4:
            # [batch, head, query, key]: the chosen positions are query rows -> [1, n_kept, head, key]
            return act.transpose(1, 2)[keep][None]
        if tuple(act.shape[:2]) != tuple(keep.shape):
            raise InputError(f"positions={self.positions!r} selects [batch, pos] positions, and hook {name!r} has "
                             f"shape {tuple(act.shape)} with no [batch, pos] leading axes: leave it out of "
                             "names_filter or use positions='all'.", argument="names_filter", value=name,
                             allowed="hooks with [batch, pos, ...] activations (or attention patterns / scores)")
        return act[keep][None]  # [1, n_kept, ...]

    def _per_sequence(self, name: str) -> bool:
        pattern = getattr(type(self.model), "per_sequence_hooks", None)
        return pattern is not None and bool(pattern.match(name))

    def run_with_cache(self, tokens: Tensor, *args: Any, names_filter: Any = None, stop_at_layer: int | None = None,
                       prepend_bos: Any = None, **kwargs: Any) -> tuple[Any, dict[str, Tensor]]:
        """Mask `tokens`, run the model, return (logits at the chosen positions, {hook name: activations at the
        chosen positions}). `stop_at_layer` (SAELens passes hook layer + 1) skips the unembedding only: the
        blocks all run, so activations are exactly those of a full forward. `prepend_bos` is accepted and
        ignored: the tokens SAELens passes are already tokenized."""
        noisy, masked = self.mask(tokens)
        self.last_masked = masked
        return_type = None if stop_at_layer is not None else "logits"
        kwargs.pop("return_type", None)
        out, cache = self.model.run_with_cache(noisy, *args, names_filter=names_filter, return_type=return_type,
                                               **kwargs)
        acts = {name: self._select(cache[name], masked, name) for name in cache.keys()}
        return (None if out is None else self._select(out, masked)), acts

    def forward(self, tokens: Tensor, **kwargs: Any) -> Any:
        """Logits of the masked canvas (at all positions; `last_masked` says which were masked)."""
        noisy, masked = self.mask(tokens)
        self.last_masked = masked
        return self.model(noisy, **kwargs)

    __call__ = forward

    def __repr__(self) -> str:
        rate = "LLaDA t~U(eps,1)" if self.mask_rate is None else self.mask_rate
        return f"MaskedCanvas({self.model!r}, mask_rate={rate}, positions={self.positions!r}, seed={self.seed})"
