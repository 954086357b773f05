"""`TransformersBridge`: a transformers-native model (DiffusionGemma, Llama, Qwen2, …) with
TransformerLens hook points, on the same surface as `HookedMDM` (`run_with_hooks`, `run_with_cache`
→ `ActivationCache`, `hooks()`, `hook_dict`, `generate`, `cfg`, `state`).

Nothing is re-implemented: the weights, the modules and their maths are transformers'. The bridge
(1) registers `mdm_lens.bridge.attention.hooked_attention_forward` as the model's attention
implementation, (2) runs each decoder layer through a hooked wrapper of its own forward, and
(3) owns the hook points under TL names:

* `blocks.{l}.*` — the layers that produce the logits: DiffusionGemma's **decoder** (the canvas, which
  attends bidirectionally to the cached prompt and to itself), or the only stack of a Llama/Qwen2.
  Globs such as `blocks.*.attn.hook_pattern`, reducers and probes therefore read the decoder.
* `encoder.{l}.*` — DiffusionGemma's **encoder** (the prompt, causal, writes the KV cache), named as
  TransformerLens' encoder-decoder models name theirs; `hook_encoder_embed`, `encoder_ln_final.*`.
* `hook_embed` (decoder token embeddings, scaled by √d), `hook_soft_embed` (DiffusionGemma's
  self-conditioning signal: softmax(previous logits)·E·√d, zeros on the first step), `ln_final.hook_out` (norm outputs, weight applied; TL's pre-weight `hook_normalized` is not exposed).

Per block: `hook_resid_pre`, `ln1.hook_out`, `attn.hook_q/hook_k` (after q/k norms, before
RoPE, own positions), `attn.hook_rot_q/hook_rot_k`, `attn.hook_v`, `attn.hook_attn_scores`,
`attn.hook_pattern` `[batch, head, query, key]`, `attn.hook_z`, `hook_attn_out` (after Gemma's
post-attention norm: what is added to the residual), `hook_resid_mid`, `ln2.hook_out`,
`mlp.hook_pre/hook_pre_linear/hook_post`, MoE `mlp.hook_router_logits/hook_expert_indices/
hook_expert_weights/hook_dense_out/hook_experts_out`, `hook_mlp_out`, `hook_resid_post`.
Key axes are absolute positions (prompt, then canvas); see `mdm_lens.bridge.attention`.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Literal, Sequence

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from mdm_lens import validate
from mdm_lens.bridge.attention import AttnHooks, register
from mdm_lens.bridge.layers import BlockHooks, NormHooks, tap, unwrap_layer, wrap_layer
from mdm_lens.module_list import IndexedModules
from mdm_lens.bridge.taps import TapPoint
from mdm_lens.bridge.spec import describe
from mdm_lens.errors import ConfigError, InputError, UnsupportedAttributeError
from mdm_lens.hook_surface import CheckedHookSurface, bound_indices

ReturnType = Literal["logits", "aligned", None]


def _dg_settings(model: Any, kwargs: dict) -> dict:
    """The LLaDA-style names the probes pass (`gen_length`, `steps`, `block_length`) in DiffusionGemma's terms:
    `gen_length` → `max_new_tokens`; `steps` (the total, as in LLaDA) → `max_denoising_steps` = steps per canvas,
    so `steps` must split evenly over the ceil(length / canvas_length) canvases; `block_length` must be the canvas
    length (the model's own block). Both names for one setting is an error."""
    from mdm_lens.errors import SamplerConfigError

    kw = dict(kwargs)
    canvas = int(model.cfg.extra["canvas_length"])
    for ours, theirs in (("gen_length", "max_new_tokens"), ("steps", "max_denoising_steps")):
        if ours in kw:
            if theirs in kw:
                raise SamplerConfigError(f"pass {ours}= or {theirs}=, not both (DiffusionGemma reads {ours} as "
                                         f"{theirs}).", argument=ours, value=kw[ours], allowed=f"one of {ours}/{theirs}")
            kw[theirs] = validate.integer(kw.pop(ours), name=ours, min=1)
            if ours == "steps":
                if "max_new_tokens" not in kw:
                    raise SamplerConfigError("steps= (the total over all canvases) needs gen_length= / max_new_tokens= "
                                             "to count the canvases; or pass max_denoising_steps= (per canvas).",
                                             argument="steps", value=kw[theirs], allowed="steps with gen_length")
                n = -(-kw["max_new_tokens"] // canvas)
                if kw[theirs] % n:
                    raise SamplerConfigError(f"steps={kw[theirs]} does not split over the {n} canvases of "
                                             f"{kw['max_new_tokens']} tokens (canvas {canvas}).", argument="steps",
                                             value=kw[theirs], allowed=f"a multiple of {n}")
                kw[theirs] //= n
    if "block_length" in kw:
        block = kw.pop("block_length")
        if block is not None and validate.integer(block, name="block_length", min=1) != canvas:
            raise SamplerConfigError(f"block_length={block}: DiffusionGemma denoises canvases of {canvas} tokens, its "
                                     "own block; leave block_length unset.", argument="block_length", value=block,
                                     allowed=f"None or {canvas}")
    return kw


_HEADS = ("per-head weight views are not built: transformers' attention modules keep their own projections "
          "(q/k norms, sliding windows, shared key/value heads), so W_Q / OV-style stacks would be copies of a "
          "layout the bridge does not run")
BRIDGE_UNSUPPORTED: dict[str, str] = {
    **dict.fromkeys(("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O", "OV", "QK", "all_composition_scores"),
                    _HEADS),
    **dict.fromkeys(("W_in", "W_out", "W_gate", "b_in", "b_out"),
                    "the MLPs (dense or mixture-of-experts) are transformers' own modules, with no stacked views"),
    "set_use_attn_result": "hook_result (each head's W_O output) is not computed: the attention output is "
                           "transformers' own o_proj; hook_z holds each head's value mix before it",
    "accumulated_bias": "the bridge builds no stacked bias views",
}


class TransformersBridge(CheckedHookSurface):
    """Hooks on a transformers model. Build with `TransformersBridge(hf_model)` or
    `TransformersBridge.from_pretrained(folder)` (also reached through `HookedMDM.from_pretrained`)."""

    hook_name_hint = "`blocks.{l}` is the decoder, `encoder.{l}` the encoder."

    def __init__(self, hf_model: nn.Module, tokenizer: Any = None):
        super().__init__()
        spec = describe(hf_model)
        self.spec, self.cfg, self.tokenizer = spec, spec.cfg, tokenizer
        self.chat_template: Any = None  # mdm_lens.chat.ChatTemplate, read from the checkpoint's tokenizer files
        self.hf = hf_model.eval()
        self.hf.set_attn_implementation(register())
        self.blocks = IndexedModules((BlockHooks(spec.moe) for _ in spec.decoder_layers), "layer")
        self.hook_embed = TapPoint()
        self.ln_final = NormHooks()
        self._taps: list[TapPoint] = []
        if spec.encoder_layers is not None:
            self.encoder = IndexedModules((BlockHooks(spec.moe) for _ in spec.encoder_layers), "encoder layer")
            self.hook_encoder_embed, self.encoder_ln_final = TapPoint(), NormHooks()
            self.hook_soft_embed = TapPoint()
            self._wrap(spec.encoder_layers, self.encoder, spec.encoder_embed, self.hook_encoder_embed,
                       spec.encoder_norm, self.encoder_ln_final)
            self.hook_soft_embed.bind(spec.self_conditioning, self._soft_embed_hook, pre=True)
            self._taps.append(self.hook_soft_embed)
        self._wrap(spec.decoder_layers, self.blocks, spec.decoder_embed, self.hook_embed, spec.decoder_norm,
                   self.ln_final)
        self.state: Any = None  # the sampler's DenoisingState while a denoising step runs
        self.setup()

    def _wrap(self, layers: Sequence[nn.Module], hooks: nn.ModuleList, embed: nn.Module, hook_embed: TapPoint,
              norm: nn.Module, ln: NormHooks) -> None:
        self._layer_handles = getattr(self, "_layer_handles", [])
        for layer, h in zip(layers, hooks):
            self._layer_handles.append((layer, wrap_layer(layer, h, self.spec.style)))
            if h.mlp.moe and self.spec.n_experts:
                bound_indices(h.mlp.hook_expert_indices, self.spec.n_experts)
        self._taps += [tap(hook_embed, embed), tap(ln.hook_out, norm)]

    def _soft_embed_hook(self, module: nn.Module, args: tuple) -> tuple | None:
        if not (self.hook_soft_embed.fwd_hooks or self.hook_soft_embed.bwd_hooks):
            return None
        inputs_embeds, soft = args
        return inputs_embeds, self.hook_soft_embed(soft)

    def setup(self) -> None:
        """TL's `setup`, over our hook containers only: transformers' modules keep their own names."""
        self.mod_dict, self.hook_dict = {}, {}
        for name, module in self.named_modules():
            if name == "" or name == "hf" or name.startswith("hf."):
                continue
            module.name = name
            self.mod_dict[name] = module
            if isinstance(module, HookPoint):
                self.hook_dict[name] = module

    def unbridge(self) -> nn.Module:
        """Remove every wrapper and hook from the transformers model and return it (SDPA attention)."""
        for layer, taps in self._layer_handles:
            unwrap_layer(layer, taps)
        for t in self._taps:
            t.unbind()
        self.hf.set_attn_implementation("sdpa")
        return self.hf

    # --- construction -------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, name_or_path: str, **kwargs: Any) -> "TransformersBridge":
        from mdm_lens.bridge.loading import load_bridge

        return load_bridge(cls, name_or_path, **kwargs)

    @property
    def is_block_diffusion(self) -> bool:
        return self.spec.encoder_layers is not None

    def set_force_explicit(self, value: bool = True) -> None:
        """Always take the explicit attention path (tests, benchmarks)."""
        for m in self.modules():
            if isinstance(m, AttnHooks):
                m.force_explicit = value

    # --- forward ------------------------------------------------------------------------------------
    @contextmanager
    def _total_keys(self, **totals: int) -> Iterator[None]:
        """Set the absolute key count of a pass on the `blocks` / `encoder` attention hooks, and put back what
        was there afterwards (not None: a forward may run inside another's hook, e.g. knockout's pre-pass)."""
        stacks = [(getattr(self, name), total) for name, total in totals.items()]
        saved = [(h.attn, h.attn.total_keys) for stack, _ in stacks for h in stack]
        for stack, total in stacks:
            for h in stack:
                h.attn.total_keys = total
        try:
            yield
        finally:
            for attn, total in saved:
                attn.total_keys = total

    def forward(self, input_ids: Int[Tensor, "batch pos"] | None = None,
                decoder_input_ids: Int[Tensor, "batch canvas"] | None = None,
                attention_mask: Int[Tensor, "batch pos"] | None = None, *, return_type: ReturnType = "logits",
                **kwargs: Any) -> Float[Tensor, "batch pos d_vocab"] | None:
        """DiffusionGemma: `model(input_ids, decoder_input_ids=canvas)` → canvas logits `[batch, canvas, vocab]`
        (softcapped, fp32, as transformers'); with `cache=` and no `input_ids`, the decoder reads an encoded
        prefix. Other keyword arguments are transformers' (`self_conditioning_logits`, `decoder_attention_mask`,
        `decoder_position_ids`, `position_ids`, …). Causal-LM families: `model(tokens, attention_mask)` →
        `[batch, pos, vocab]`. `return_type`: "logits" (= "aligned": no family here shifts) or None."""
        validate.choice(return_type, ("logits", "aligned", None), name="return_type")
        if self.is_block_diffusion:
            logits = self._forward_block_diffusion(input_ids, decoder_input_ids, attention_mask, **kwargs)
        else:
            if decoder_input_ids is not None:
                raise InputError(f"{self.cfg.model_name} is not an encoder-decoder model: pass tokens only, "
                                 "not decoder_input_ids.")
            tokens = self._check_ids(input_ids, "input_ids")
            if attention_mask is not None:
                validate.tensor(attention_mask, name="attention_mask", shape=tuple(tokens.shape))
            with self._total_keys(blocks=tokens.shape[1]):
                logits = self.hf(input_ids=tokens, attention_mask=attention_mask, **kwargs).logits
        return None if return_type is None else logits

    def _check_ids(self, ids: Any, name: str) -> Tensor:
        if ids is None:
            raise InputError(f"{name} is required: token ids [batch, pos].")
        ids = torch.as_tensor(ids)
        if ids.ndim == 1:
            ids = ids[None]
        validate.tensor(ids, name=name, ndim=2, dtype="int")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.cfg.d_vocab:
            raise InputError(f"{name} must lie in [0, {self.cfg.d_vocab}), got range [{lo}, {hi}].")
        return ids.to(self.input_device)

    def _forward_block_diffusion(self, input_ids: Any, canvas: Any, attention_mask: Any, **kwargs: Any) -> Tensor:
        if canvas is None:
            raise InputError(
                "DiffusionGemma is an encoder-decoder: a forward needs the canvas, model(input_ids, "
                "decoder_input_ids=canvas). For one forward of a whole sequence (prompt + answer) use "
                "mdm_lens.bridge.sequence.sequence_forward, or pass prompt_length= to the probes "
                "(absorption_by_layer, qk_at_layer, final_attention).")
        canvas = self._check_ids(canvas, "decoder_input_ids")
        cache = kwargs.get("cache")
        past = int(cache.get_seq_length()) if cache is not None else 0
        if input_ids is None:
            if cache is None:
                raise InputError("pass the prompt (input_ids) or an encoded prefix (cache=) with decoder_input_ids.")
            prefix = past
        else:
            input_ids = self._check_ids(input_ids, "input_ids")
            if input_ids.shape[0] != canvas.shape[0]:
                raise InputError(f"input_ids batch {input_ids.shape[0]} != decoder_input_ids batch {canvas.shape[0]}.")
            if attention_mask is not None:
                validate.tensor(attention_mask, name="attention_mask", shape=tuple(input_ids.shape))
            prefix = past + input_ids.shape[1]
        with self._total_keys(encoder=prefix, blocks=prefix + canvas.shape[1]):
            return self.hf(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=canvas,
                           **kwargs).logits

    def encode(self, input_ids: Tensor, cache: Any, attention_mask: Any = None, position_ids: Any = None) -> Any:
        """DiffusionGemma's encoder pass alone (writes `cache`), with the `encoder.*` hooks."""
        past = int(cache.get_seq_length())
        with self._total_keys(encoder=past + input_ids.shape[1]):
            return self.hf.model.encoder(input_ids=input_ids, attention_mask=attention_mask, cache=cache,
                                         position_ids=position_ids)

    def generate(self, prompt: Any, **kwargs: Any) -> Any:
        """DiffusionGemma: `sampler="diffusion_gemma"` (the default), see `mdm_lens.diffusion.diffusion_gemma`;
        bidirectional Llama/Qwen2 checkpoints: the LLaDA/Dream samplers; causal ones: "arm"."""
        from mdm_lens.diffusion.generate import generate

        if self.is_block_diffusion:
            sampler = validate.choice(kwargs.pop("sampler", "diffusion_gemma"), ("diffusion_gemma", "auto"),
                                      name="sampler")
            return generate(self, prompt, sampler=sampler, **_dg_settings(self, kwargs))
        return generate(self, prompt, **kwargs)

    def aligned_logits(self, raw: Tensor) -> Tensor:
        return raw

    # --- hooks: TL machinery, with a typed error for names that do not exist --------------------------
    # --- TL weight surface (read-only views of transformers' parameters) ----------------------------
    @property
    def W_E(self) -> Float[Tensor, "d_vocab d_model"]:
        return self.spec.decoder_embed.weight

    def final_logits(self, x: Tensor) -> Float[Tensor, "batch pos d_vocab"]:
        """Logits from `ln_final.hook_out` as transformers computes them: lm_head, fp32, then DiffusionGemma's
        final softcapping (when the config has one)."""
        validate.tensor(x, name="x", dtype="float")
        if x.shape[-1] != self.cfg.d_model:
            raise InputError(f"x has {x.shape[-1]} features, the final norm's output has d_model={self.cfg.d_model}.",
                             argument="x", value=tuple(x.shape), allowed=f"[..., {self.cfg.d_model}]")
        logits = self.hf.lm_head(x).to(torch.float32)
        cap = getattr(self.hf.config.get_text_config(), "final_logit_softcapping", None)
        return logits if cap is None else torch.tanh(logits / cap) * cap

    @property
    def input_device(self) -> torch.device:
        """Where token ids go: the embedding's execution device. Under accelerate offloading (device_map with
        "cpu"/"disk" entries) the weight itself sits on the meta device and is loaded per call."""
        embed = self.spec.encoder_embed if self.is_block_diffusion else self.spec.decoder_embed
        hook = getattr(embed, "_hf_hook", None)
        device = getattr(hook, "execution_device", None)
        return torch.device(device) if device is not None else embed.weight.device

    @property
    def W_U(self) -> Float[Tensor, "d_model d_vocab"]:
        return self.hf.lm_head.weight.T

    supported_cache_helpers = ("indexing, accumulated_resid(apply_ln=False), decompose_resid(apply_ln=False) "
                               "where the residual is a plain sum (not DiffusionGemma), and model.final_logits(x)")

    @property
    def unsupported_cache_helpers(self) -> dict[str, str]:
        """TL's cache helpers whose math needs weight views the bridge does not build (W_O, W_U directions, the
        final norm as a module), and on DiffusionGemma the residual split itself: each layer's output is scaled by
        a learned per-layer scalar and the embedding by √d_model, which the TL parts leave out."""
        views = ("it needs TL weight views (W_O / W_out / token directions / the final norm's scale) the bridge "
                 "does not build")
        refused = {h: views for h in ("logit_attrs", "apply_ln_to_stack", "stack_head_results",
                                      "stack_neuron_results", "get_neuron_results", "get_full_resid_decomposition",
                                      "accumulated_resid(apply_ln=True)", "decompose_resid(apply_ln=True)")}
        if self.is_block_diffusion:
            refused["decompose_resid"] = ("DiffusionGemma scales each layer's output by a learned per-layer scalar and "
                                          "the embedding by √d_model, so TL's embed / attn_out / mlp_out parts do not "
                                          "sum to the residual; read the residual hooks (accumulated_resid)")
        return refused

    def __getattr__(self, name: str) -> Any:
        # nn.Module resolves parameters and submodules here; a TL name HookedMDM has and the bridge does not build
        # is refused with the reason instead of a bare AttributeError
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name not in BRIDGE_UNSUPPORTED:
                raise
        raise UnsupportedAttributeError(
            f"model.{name} is not defined on the transformers-native bridge: {BRIDGE_UNSUPPORTED[name]}. Available "
            "here: W_E, W_U, final_logits, transformers' parameters (model.hf.named_parameters()), and every hook "
            "point (run_with_cache).", argument=name, value=name, allowed="W_E, W_U, final_logits, hooks")

    def process_weights_(self, *args: Any, **kwargs: Any) -> None:
        """Refused: the bridge runs transformers' own modules (norms with offsets such as Gemma's `1 + w`,
        softcapping), so TL's weight processing is not implemented here; use `HookedMDM` for folded analyses."""
        raise ConfigError("process_weights_ (fold_ln, center_unembed, fold_value_biases) is not available on the "
                          "transformers-native bridge: its norms and heads are transformers' own modules. Analyse "
                          "the unprocessed model (include the final norm's weight in logit directions), or use a "
                          "family HookedMDM implements.")

    def to_tokens(self, text: str | Sequence[str], prepend_bos: bool | None = None,
                  padding_side: Literal["left", "right"] = "left", return_attention_mask: bool = False) -> Any:
        """As `HookedMDM.to_tokens` (the same function; no import of the native model, so no cycle)."""
        from mdm_lens import tokenization

        return tokenization.to_tokens(self, text, prepend_bos, padding_side, return_attention_mask)

    def to_str_tokens(self, tokens: Any) -> list[str]:
        from mdm_lens import tokenization

        tok = tokenization.require(self.tokenizer)
        t = torch.as_tensor(tokens).reshape(-1)
        return [tokenization.id_to_token(tok, int(i)) for i in t]

    def __repr__(self) -> str:
        c = self.cfg
        parts = f"encoder+decoder {c.n_layers}+{c.n_layers}" if self.is_block_diffusion else f"layers={c.n_layers}"
        return (f"TransformersBridge({c.model_name!r}, {type(self.hf).__name__}, {parts}, d_model={c.d_model}, "
                f"heads={c.n_heads}, moe={self.spec.moe}, dtype={str(self.W_E.dtype).removeprefix('torch.')})")
