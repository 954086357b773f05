"""Layer wrappers: transformers' own decoder layers, run with TransformerLens hook points between
their submodules. Each wrapper is the layer's own forward, line for line, with a hook call wherever
TL has a name; the submodules (attention, norms, MLP, router, experts) are transformers' objects.

Two layer shapes are covered: Gemma-4 style (DiffusionGemma encoder and decoder layers: post-norms,
a dense MLP beside a routed MoE, a layer scalar) and Llama style (Llama, Qwen2, Mistral, …).

Speed: a layer none of whose hook points is hooked runs transformers' own forward (the wrapper
costs ~2% of a forward in Python calls), and the taps on submodule outputs (q/k, router logits,
norms, embeddings) are torch hooks only while hooked (`mdm_lens.bridge.taps`).
"""

from __future__ import annotations

from typing import Any, Callable

from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from mdm_lens.bridge.attention import AttnHooks, attach, detach, hooked
from mdm_lens.bridge.taps import TapPoint


def _h(hp: HookPoint, x: Tensor) -> Tensor:
    return hp(x) if hooked(hp) else x


class NormHooks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hook_out = TapPoint()  # the norm's output, weight applied (TL's hook_normalized is before it)


class MLPHooks(nn.Module):
    """`mlp.hook_pre` (gate side, before the activation), `hook_pre_linear` (up side), `hook_post`
    (act(gate)·up); MoE layers add `hook_router_logits` `[batch, pos, expert]` (router scores before
    softmax), `hook_expert_indices` / `hook_expert_weights` `[batch, pos, top_k]` (after the
    renormalisation and per-expert scale), `hook_dense_out` and `hook_experts_out` (each branch after
    its post-norm; their sum, post-normed, is `hook_mlp_out`)."""

    def __init__(self, moe: bool) -> None:
        super().__init__()
        for name in ("hook_pre", "hook_pre_linear", "hook_post"):
            setattr(self, name, HookPoint())
        self.moe = moe
        if moe:
            self.hook_router_logits = TapPoint()
            for name in ("hook_expert_indices", "hook_expert_weights", "hook_dense_out", "hook_experts_out"):
                setattr(self, name, HookPoint())
        self.__dict__["token_shape"] = ()  # plain attribute: set on every MoE layer call


class BlockHooks(nn.Module):
    def __init__(self, moe: bool) -> None:
        super().__init__()
        for name in ("hook_resid_pre", "hook_attn_out", "hook_resid_mid", "hook_mlp_out", "hook_resid_post"):
            setattr(self, name, HookPoint())
        self.ln1, self.ln2 = NormHooks(), NormHooks()
        self.attn = AttnHooks()
        self.mlp = MLPHooks(moe)
        # the points only the hooked layer forward fires; attention points fire inside the attention
        # function and taps on their own modules, whichever layer forward runs
        inner = set(self.attn.modules())
        self.__dict__["_points"] = [m for m in self.modules() if isinstance(m, HookPoint) and m not in inner
                                    and not isinstance(m, TapPoint)]

    def active(self) -> bool:
        """Something hooks a point that needs the hooked layer forward."""
        return any(hp.fwd_hooks or hp.bwd_hooks for hp in self._points)


def gated_mlp(mlp: nn.Module, hooks: MLPHooks, x: Float[Tensor, "batch pos d_model"]) -> Tensor:
    """down(act(gate(x)) · up(x)) — transformers' Gemma/Llama MLP, with the TL hooks between."""
    gate = _h(hooks.hook_pre, mlp.gate_proj(x))
    up = _h(hooks.hook_pre_linear, mlp.up_proj(x))
    return mlp.down_proj(_h(hooks.hook_post, mlp.act_fn(gate) * up))


def gemma_layer_forward(layer: nn.Module, hooks: BlockHooks, hidden_states: Tensor,
                        position_embeddings: Any = None, attention_mask: Any = None, position_ids: Any = None,
                        cache: Any = None, **kwargs: Any) -> Tensor:
    """`DiffusionGemma{Encoder,Decoder}TextLayer.forward` with hooks."""
    hidden_states = _h(hooks.hook_resid_pre, hidden_states)
    residual = hidden_states
    x = _h(hooks.ln1.hook_out, layer.input_layernorm(hidden_states))
    attn, _ = layer.self_attn(hidden_states=x, position_embeddings=position_embeddings, attention_mask=attention_mask,
                              position_ids=position_ids, cache=cache, **kwargs)
    attn = _h(hooks.hook_attn_out, layer.post_attention_layernorm(attn))
    hidden_states = _h(hooks.hook_resid_mid, residual + attn)
    residual = hidden_states
    x = _h(hooks.ln2.hook_out, layer.pre_feedforward_layernorm(hidden_states))
    dense = layer.post_feedforward_layernorm_1(gated_mlp(layer.mlp, hooks.mlp, x))
    flat = residual.reshape(-1, residual.shape[-1])  # routing reads the residual, as in transformers
    experts_in = layer.pre_feedforward_layernorm_2(flat)
    hooks.mlp.__dict__["token_shape"] = tuple(residual.shape[:-1])
    _, weights, index = layer.router(flat)
    tok = hooks.mlp.token_shape
    if hooked(hooks.mlp.hook_expert_indices):
        index = hooks.mlp.hook_expert_indices(index.view(*tok, -1)).reshape(index.shape)
    if hooked(hooks.mlp.hook_expert_weights):
        weights = hooks.mlp.hook_expert_weights(weights.view(*tok, -1)).reshape(weights.shape)
    experts = layer.post_feedforward_layernorm_2(layer.experts(experts_in, index, weights).reshape(residual.shape))
    dense = _h(hooks.mlp.hook_dense_out, dense)
    experts = _h(hooks.mlp.hook_experts_out, experts)
    mlp_out = _h(hooks.hook_mlp_out, layer.post_feedforward_layernorm(dense + experts))
    hidden_states = residual + mlp_out
    hidden_states *= layer.layer_scalar  # in place, as transformers
    return _h(hooks.hook_resid_post, hidden_states)


def llama_layer_forward(layer: nn.Module, hooks: BlockHooks, hidden_states: Tensor, attention_mask: Any = None,
                        position_ids: Any = None, cache: Any = None, use_cache: bool | None = False,
                        position_embeddings: Any = None, **kwargs: Any) -> Tensor:
    """`LlamaDecoderLayer.forward` (also Qwen2's, Mistral's) with hooks."""
    hidden_states = _h(hooks.hook_resid_pre, hidden_states)
    residual = hidden_states
    x = _h(hooks.ln1.hook_out, layer.input_layernorm(hidden_states))
    attn, _ = layer.self_attn(hidden_states=x, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                              use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
    attn = _h(hooks.hook_attn_out, attn)
    hidden_states = _h(hooks.hook_resid_mid, residual + attn)
    x = _h(hooks.ln2.hook_out, layer.post_attention_layernorm(hidden_states))
    mlp_out = _h(hooks.hook_mlp_out, gated_mlp(layer.mlp, hooks.mlp, x))
    return _h(hooks.hook_resid_post, hidden_states + mlp_out)


def _output_hook(hp: HookPoint, shape: Callable[[Tensor, Any], tuple[int, ...]] | None = None) -> Callable:
    """A torch forward hook that passes a submodule's output through a TL hook point (reshaped to TL's
    layout and back when `shape` is given); a no-op while nothing hooks `hp`."""

    def fn(module: nn.Module, args: Any, out: Tensor) -> Tensor | None:
        if not hooked(hp):
            return None
        if shape is None:
            return hp(out)
        return hp(out.view(shape(out, module))).reshape(out.shape)

    return fn


def tap(point: TapPoint, module: nn.Module, shape: Callable[[Tensor, Any], tuple[int, ...]] | None = None) -> TapPoint:
    point.bind(module, _output_hook(point, shape))
    return point


def wrap_layer(layer: nn.Module, hooks: BlockHooks, style: str) -> list[TapPoint]:
    """Install the hooked forward on one transformers layer; returns the taps for `unwrap_layer`."""
    hooked_forward = gemma_layer_forward if style == "gemma" else llama_layer_forward
    # accelerate (device_map across devices, offloading) wraps a layer's forward as `_hf_hook.pre_forward →
    # _old_forward → post_forward`, which moves the inputs to the layer's device and loads offloaded weights:
    # ours goes in as `_old_forward`, inside those hooks. Replacing `forward` would skip them.
    slot = "_old_forward" if hasattr(layer, "_hf_hook") and "_old_forward" in layer.__dict__ else "forward"
    own_forward = getattr(layer, slot) if slot == "_old_forward" else type(layer).forward.__get__(layer)

    def forward(*a: Any, **kw: Any) -> Any:
        if hooks.active():
            return hooked_forward(layer, hooks, *a, **kw)
        return own_forward(*a, **kw)

    forward.mdm_lens_restore = own_forward if slot == "_old_forward" else None  # unwrap_layer: None = delete
    setattr(layer, slot, forward)  # an instance attribute: nn.Module (or accelerate's new_forward) calls it
    attn = layer.self_attn
    attach(attn, hooks.attn)
    if style == "gemma":  # q/k after their RMSNorm, before RoPE: [batch, pos, head, d_head] already
        router_shape = lambda out, m: (*hooks.mlp.token_shape, out.shape[-1])  # noqa: E731
        return [tap(hooks.attn.hook_q, attn.q_norm), tap(hooks.attn.hook_k, attn.k_norm),
                tap(hooks.mlp.hook_router_logits, layer.router.proj, router_shape)]
    head_shape = lambda out, m: (*out.shape[:-1], -1, attn.head_dim)  # noqa: E731
    return [tap(hooks.attn.hook_q, attn.q_proj, head_shape), tap(hooks.attn.hook_k, attn.k_proj, head_shape)]


def unwrap_layer(layer: nn.Module, taps: list[TapPoint]) -> None:
    for slot in ("_old_forward", "forward"):
        fn = layer.__dict__.get(slot)
        if hasattr(fn, "mdm_lens_restore"):
            if fn.mdm_lens_restore is None:
                del layer.__dict__[slot]
            else:
                layer.__dict__[slot] = fn.mdm_lens_restore
    detach(layer.self_attn)
    for t in taps:
        t.unbind()
