"""`HookedDDiT`: the DDiT diffusion LMs (MDLM, Duo; BD3LM and GIDD build on it) as a TransformerLens
`HookedRootModule` with the same surface as `HookedMDM` (run_with_cache / run_with_hooks / hooks / ActivationCache /
generate). `HookedMDM.from_pretrained(folder)` returns one for a folder whose config.json names a DDiT family.

The forward takes the conditioning scalar σ per batch row: `model(tokens, sigma=...)`."""

from __future__ import annotations

import re

from typing import Any, Literal

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from mdm_lens.module_list import IndexedModules
from mdm_lens import validate
from mdm_lens.config import MDMConfig
from mdm_lens.precision import compute_dtype
from mdm_lens.ddit.components import (AdaLN, DDiTBlock, DDiTEmbed, TimestepEmbedder, WeightLayerNorm, modulate,
                                      rotary_tables)
from mdm_lens.tokenization import TokenizerMethods
from mdm_lens.ddit.outputs import (RETURN_TYPES, check_sigma, check_tokens, finish, refuse_keywords,
                                   warn_sigma_ignored)
from mdm_lens.ddit.unsupported import UNSUPPORTED_ATTRIBUTES, refused_attribute

FORWARD_KEYWORDS = ("tokens", "sigma", "return_type", "attention_mask")
from mdm_lens.errors import InputError
from mdm_lens.hook_surface import CheckedHookSurface
from mdm_lens.loading.placement import execution_device
from mdm_lens.offload_checks import guard_views


CLEAN_T = 1e-5  # the samplers' default last time (their `eps`): a final sequence's noise level


class HookedDDiT(TokenizerMethods, CheckedHookSurface):
    """A DDiT model with TL hook points.

    Conditioning: `hook_sigma` [batch] (the σ the network uses: zeros when `time_conditioning` is off, as the
    reference zeroes it), `time_embed.hook_freqs` [batch, 256], `hook_time_embed` [batch, cond] (the embedder MLP's
    output), `hook_cond` [batch, cond] (after the outer SiLU: what every adaLN reads). Per block: see `DDiTBlock`.
    Final layer: `ln_final.hook_normalized`, `final_adaLN.hook_shift/hook_scale`, `hook_final_modulated`."""

    # hooks of the conditioning path: one value per sequence ([batch, ...], no position axis); a [batch, d] adaLN
    # term would pass a [batch, pos] shape test whenever d equals the canvas length, so callers ask by name
    per_sequence_hooks = re.compile(r"^(hook_sigma|time_embed\.hook_freqs|hook_time_embed|hook_cond|"
                                    r"blocks\.\d+\.adaLN\.hook_\w+|final_adaLN\.hook_\w+)$")

    # TL's ActivationCache helpers that assume a TL block (W_O / W_out projecting ungated head / neuron outputs, a
    # final LayerNorm followed by a linear unembedding) are wrong for DDiT: each branch is scaled by its adaLN gate
    # and the final norm is modulated by σ (shift and scale per batch row), so they are refused by name
    supported_cache_helpers = ("indexing, accumulated_resid(apply_ln=False), decompose_resid(apply_ln=False), "
                               "model.readout(resid, sigma) for the logits of a residual")
    unsupported_cache_helpers = {
        **{f"{h}(apply_ln=True)": "the final norm is followed by the σ-dependent adaLN modulation, so the cached "
           "LayerNorm scale is not the readout's; read logits with model.readout(resid, sigma)"
           for h in ("accumulated_resid", "decompose_resid")},
        "apply_ln_to_stack": "the final norm is followed by the σ-dependent adaLN modulation (model.readout applies "
                             "both)",
        "logit_attrs": "the readout is σ-modulated (no fixed residual directions per token); use "
                       "model.readout(resid, sigma)",
        **{h: "each head's / neuron's output reaches the residual scaled by the block's adaLN gate, which TL's "
           "W_O / W_out product leaves out (hook_attn_out / hook_mlp_out hold the gated branch outputs)"
           for h in ("stack_head_results", "get_full_resid_decomposition", "stack_neuron_results",
                     "get_neuron_results")},
    }

    hook_name_hint = "names follow TransformerLens, e.g. 'blocks.0.attn.hook_pattern', 'hook_cond'."
    families: tuple[str, ...] = ("mdlm", "duo")  # the research families from_pretrained loads into this class
    # `loading.save_pretrained` writes HookedMDM's config (RMSNorm, no σ conditioning): refused, saying what to do
    native_format_refusal = ("that format describes HookedMDM's blocks (RMSNorm, no adaLN, no σ conditioning) and the "
                             "folder would not load; this model is never processed, so the checkpoint folder it was "
                             "loaded from already holds exactly its weights: copy that folder (or torch.save "
                             "model.state_dict())")

    def __init__(self, cfg: MDMConfig, tokenizer: Any = None):
        super().__init__()
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.chat_template: Any = None
        self.embed = DDiTEmbed(cfg)  # first: `from_config` draws the parameters in registration order
        self.time_embed = TimestepEmbedder(cfg)
        self.blocks = IndexedModules((DDiTBlock(cfg, layer) for layer in range(cfg.n_layers)), "layer")
        self.ln_final = WeightLayerNorm(cfg)
        self.final_adaLN = AdaLN(cfg, ("shift", "scale"))
        self.unembed = nn.Linear(cfg.d_model, cfg.d_vocab, dtype=cfg.dtype)
        for name in ("sigma", "time_embed", "cond", "embed", "final_modulated"):
            setattr(self, f"hook_{name}", HookPoint())
        self.state: Any = None  # the sampler's DenoisingState while a denoising step runs
        # True: the references' GPU numerics, blocks and final layer under bf16 autocast (`set_autocast`)
        self.autocast = False
        self.setup()

    @classmethod
    def from_config(cls, cfg: MDMConfig, seed: int | None = 0, init_std: float = 0.02, tokenizer: Any = None,
                    init: Literal["normal", "realistic"] = "realistic") -> "HookedDDiT":
        """Random weights: normal(0, init_std) matrices and embeddings; `init="realistic"` (default) draws norm
        weights log-normal around 1 and every bias (adaLN ones included) non-zero (`mdm_lens.init.realistic_`)."""
        from mdm_lens.init import realistic_

        init = validate.choice(init, ("normal", "realistic"), name="init")
        init_std = validate.number(init_std, name="init_std", min=0, min_open=True)
        model = cls(cfg, tokenizer=tokenizer)
        gen = None if seed is None else torch.Generator().manual_seed(validate.seed(seed, min=None))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".w"):
                    p.fill_(1.0)
                else:
                    p.copy_(init_std * torch.randn(p.shape, generator=gen).to(p.dtype))
        if init == "realistic":
            realistic_(model, seed=0 if seed is None else seed)
        return model.eval()

    @classmethod
    def from_pretrained(cls, name_or_path: str, **kwargs: Any) -> "HookedDDiT":
        from mdm_lens.ddit.loading import load_ddit

        return load_ddit(cls, name_or_path, **kwargs)

    @classmethod
    def from_pretrained_no_processing(cls, name_or_path: str, **kwargs: Any) -> "HookedDDiT":
        """TL's name for loading without weight processing: the same as `from_pretrained` (a DDiT model is never
        processed, `mdm_lens.ddit.unsupported`)."""
        return cls.from_pretrained(name_or_path, **kwargs)

    def __getattr__(self, name: str) -> Any:
        # nn.Module resolves parameters and submodules here; a TL name HookedMDM has and a DDiT model cannot honour
        # (process_weights_, OV, W_Q, …) is refused with the reason instead of a bare AttributeError
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name not in UNSUPPORTED_ATTRIBUTES:
                raise
        raise refused_attribute(type(self).__name__, name)

    # --- TL views ------------------------------------------------------------------------------------
    @property
    def W_E(self) -> Float[Tensor, "d_vocab d_model"]:
        return self.embed.W_E

    @property
    def W_U(self) -> Float[Tensor, "d_model d_vocab"]:
        return self.unembed.weight.T

    @property
    def b_U(self) -> Float[Tensor, "d_vocab"]:
        return self.unembed.bias

    @property
    def input_device(self) -> torch.device:
        """Where token ids go: the embedding's execution device (under a device map with disk offload its weight
        sits on meta; `mdm_lens.loading.placement`)."""
        return execution_device(self.embed, lambda: self.embed.W_E.device)

    # --- forward -------------------------------------------------------------------------------------
    def conditioning(self, sigma: Float[Tensor, "batch"]) -> Float[Tensor, "batch cond"]:
        if not self.cfg.extra["time_conditioning"]:
            sigma = torch.zeros_like(sigma)  # the reference zeroes σ; the adaLN path still runs on c(0)
        sigma = self.hook_sigma(sigma)
        emb = self.hook_time_embed(self.time_embed(sigma))
        return self.hook_cond(torch.nn.functional.silu(emb))

    def forward(self, tokens: Int[Tensor, "batch pos"], sigma: Any = None, return_type: str | None = "logits",
                attention_mask: Tensor | None = None, **unknown: Any) -> Any:
        """Logits of the DDiT network at conditioning σ (a keyword it does not take, e.g. `t=`, is an InputError
        naming the one to use).

        Args:
            tokens: ids `[batch, pos]` (pos ≤ n_ctx, the checkpoint's `model_length`).
            sigma: a number or a `[batch]` tensor of σ ≥ 0 (MDLM: the log-linear total noise, zeroed inside when
                `time_conditioning` is off; Duo: −log α_t). Omitted: `step_sigma()` (the running step's σ, else
                the clean-data σ at t = 1e-5).
            return_type: "logits" / "aligned" (raw logits: position i predicts token i), "log_probs" (the family's
                output parameterisation: MDLM SUBS — −1e6 at the mask id, log-softmax, unmasked rows one-hot at
                their own token (0 there, −1e6 elsewhere); Duo log-softmax), "subs", "log_softmax", or None.
            attention_mask: accepted for the sampler interface only; DDiT attends everywhere (must be all ones).
        """
        refuse_keywords(unknown, FORWARD_KEYWORDS, self.cfg)
        return_type = validate.choice(return_type, RETURN_TYPES, name="return_type")
        tokens = check_tokens(tokens, self.cfg, attention_mask)
        if sigma is not None and self.state is None and not self.cfg.extra["time_conditioning"]:
            warn_sigma_ignored(self)
        sigma = check_sigma(self.step_sigma() if sigma is None else sigma, tokens.shape[0], self.cfg, tokens.device)
        c = self.conditioning(sigma)  # fp32 (float64 models: float64): the references compute it outside autocast
        resid = self.hook_embed(self.embed(tokens))
        cos, sin = rotary_tables(tokens.shape[1], self.cfg.d_head, self.cfg.rope_theta, tokens.device,
                                 compute_dtype(self.cfg.dtype))
        with torch.autocast(device_type=tokens.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            for block in self.blocks:
                resid = block(resid, c, cos, sin)
            if return_type is None:
                return None
            z = self.hook_final_modulated(self.final_modulate(resid, c))
            raw = self.unembed(z)
        return finish(raw, tokens.to(raw.device), return_type, self.cfg)

    def final_modulate(self, resid: Float[Tensor, "batch pos d_model"], c: Float[Tensor, "batch cond"]
                       ) -> Float[Tensor, "batch pos d_model"]:
        """The output layer's adaLN: `ln_final(resid)·(1 + scale) + shift`. Under a device map `final_adaLN` and
        `ln_final` may compute on different devices; the modulation moves to the normalised residual's."""
        m = self.final_adaLN(c)
        x = self.ln_final(resid)
        # fp32 like the blocks' modulation, then the unembedding's dtype (a bf16 / fp16 model's readout)
        return modulate(x, m["shift"].to(x.device), m["scale"].to(x.device)).to(self.unembed.weight.dtype)

    def set_autocast(self, enabled: bool = True) -> "HookedDDiT":
        """The autocast-faithful path: the blocks and the final layer run under `torch.autocast(bfloat16)` as the
        MDLM / Duo references do on GPU (qkv, attention, MLP, adaLN outputs and logits bf16; the LayerNorms fp32;
        `gate · branch` rounded to bf16 before the fp32 residual add; σ embedding and rotary tables fp32). Not
        bit-identical to the references' kernels (flash-attn, Triton rotary): compare by tolerance and argmax.
        The default (off) is the fp32 execution of the reference math, the parity the tests check."""
        self.autocast = validate.boolean(enabled, name="enabled")
        return self

    def step_sigma(self) -> Tensor | float | None:
        """The σ a forward called without `sigma` uses: the running denoising step's (`model.state.extra["sigma"]`,
        set by the DDiT samplers, `out.replay`, `out.at_step`, nnsight's `tracer.iter[k]`); outside a step, the
        clean-data σ (t = `CLEAN_T` = the samplers' last grid time 1e-5, σ = −log(1 − (1 − 1e-3)·t) ≈ 1e-5): what a
        fully denoised sequence is conditioned on, and what the probes' clean forwards of a final sequence use.
        MDLM without time conditioning zeroes σ anyway."""
        state_sigma = None if self.state is None else self.state.extra.get("sigma")
        if state_sigma is not None:
            return state_sigma
        return float(-torch.log1p(torch.tensor(-(1 - 1e-3) * CLEAN_T)))

    # --- readout: what the knockout scorer and the lenses read ------------------------------------------
    readout_hook = "hook_final_modulated"  # the unembedding's input: raw logits = unembed(this)

    def readout(self, resid: Float[Tensor, "... d_model"], sigma: Any = None) -> Float[Tensor, "... d_vocab"]:
        """Raw logits of a final-layer residual: final norm, the final adaLN at `sigma` (default `step_sigma()`:
        the running step's σ, else the clean σ), unembedding. Rows `[batch, pos, d_model]` take one σ per batch
        row; any other shape takes one σ for all."""
        resid = validate.tensor(resid, name="resid", dtype="float")
        if resid.ndim == 0 or resid.shape[-1] != self.cfg.d_model:
            raise InputError(f"resid has shape {tuple(resid.shape)}: readout takes residuals of width d_model="
                             f"{self.cfg.d_model} (last axis).", argument="resid", value=tuple(resid.shape),
                             allowed=f"[..., {self.cfg.d_model}]")
        flat = resid.ndim != 3
        r = resid.reshape(1, -1, resid.shape[-1]) if flat else resid
        sigma = self.step_sigma() if sigma is None else sigma
        if flat and isinstance(sigma, Tensor) and sigma.numel() > 1:  # one σ for rows of unknown batch
            if bool((sigma != sigma.reshape(-1)[0]).any()):
                raise InputError(f"readout of a {tuple(resid.shape)} tensor takes one σ; got {sigma.tolist()}.",
                                 argument="sigma", value=sigma, allowed="a number (or equal values)")
            sigma = sigma.reshape(-1)[:1]
        sigma = check_sigma(sigma, r.shape[0], self.cfg, r.device)
        return self.unembed(self.final_modulate(r, self.conditioning(sigma))).reshape(*resid.shape[:-1], -1)

    def aligned_logits(self, raw: Tensor) -> Tensor:
        return raw  # DDiT logits are position-aligned (row i predicts token i)

    def generate(self, prompt: Any, **kwargs: Any) -> Any:
        """Run a registered sampler ("mdlm" for MDLM, "duo" for Duo); see `mdm_lens.diffusion.generate`."""
        from mdm_lens.diffusion.generate import generate

        return generate(self, prompt, **kwargs)

    def memory_plan(self, prompt: Any = None, sampler: str = "auto", **kwargs: Any) -> Any:
        """Per-device bytes of `generate(prompt, **kwargs)` before running it, as `HookedMDM.memory_plan`
        (`mdm_lens.hooks.plan`: weights, streamed offloaded blocks, activations per device of `hf_device_map`);
        `.check()` refuses a run over a budget. The KV-cache column is the generic 2·d_model per position and
        layer; BD3LM's cache holds q, k and v of `model_length` positions (3·d_model·model_length per layer)."""
        from mdm_lens.diffusion.generate import default_sampler
        from mdm_lens.diffusion.memory_guard import memory_plan

        name = default_sampler(self) if sampler == "auto" else sampler
        return memory_plan(self, prompt, sampler=name, **kwargs)

    def __repr__(self) -> str:
        c = self.cfg
        return (f"HookedDDiT({c.family} {c.model_name!r}: {c.n_layers} layers, d_model {c.d_model}, {c.n_heads} heads, "
                f"cond {c.extra['cond_dim']}, vocab {c.d_vocab}, time_conditioning={c.extra['time_conditioning']})")


# an offloaded embedding / head holds its weights on meta outside its forward: views refuse, naming it
guard_views(HookedDDiT, ["W_E"], part="embed")
guard_views(HookedDDiT, ["W_U", "b_U"], part="unembed")
