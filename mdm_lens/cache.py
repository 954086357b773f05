"""`MDMActivationCache`: TransformerLens' `ActivationCache` whose lookups fail with typed errors.

TL's cache answers ``cache["pattern", 7]`` on a 4-layer model, or a name that was not cached, with a bare
``KeyError('blocks.7.attn.hook_pattern')``. Here an out-of-range layer raises `OutOfRangeError` naming the valid
range (negative layers count from the end, as in TL), and a missing name raises `HookNameError` (a `KeyError`,
so ``except KeyError`` still works) naming the nearest cached names and whether the model has that hook point at
all (then it was filtered out by ``names_filter``). Every other behaviour is TL's: it *is* an `ActivationCache`.
"""

from __future__ import annotations

import difflib
import numbers
from typing import Any

from torch import Tensor
from transformer_lens import ActivationCache
from transformer_lens.utilities import get_act_name
from transformer_lens.utilities.slice import Slice

from mdm_lens import cache_args, validate
from mdm_lens.errors import ArgumentError, ArgumentTypeError, HookNameError, OutOfRangeError, UnsupportedAttributeError

__all__ = ["MDMActivationCache"]


class MDMActivationCache(ActivationCache):
    """An `ActivationCache` (isinstance holds) whose missing keys and out-of-range layers raise typed errors."""

    def __getitem__(self, key: Any) -> Tensor:
        if isinstance(key, str):
            if key in self.cache_dict:
                return self.cache_dict[key]
            return self._lookup(get_act_name(key), key)
        if not isinstance(key, tuple) or not key or not isinstance(key[0], str):
            raise ArgumentTypeError(f"cache[{validate.describe(key)}]: a key is a hook name or a tuple (name, layer"
                                    "[, layer_type]) as in TransformerLens.", argument="key", value=key,
                                    allowed="str or (str, int[, str])")
        if len(key) > 3:  # TL's get_act_name would raise a raw TypeError
            raise ArgumentTypeError(f"cache[{key!r}]: a key is (name, layer[, layer_type]); index the tensor after "
                                    f"(e.g. cache[{key[0]!r}, {key[1]!r}][:, {key[3]!r}] for a head).",
                                    argument="key", value=key, allowed="str or (str, int[, str])")
        if len(key) > 1 and key[1] is not None:
            n_layers = self.model.cfg.n_layers
            layer = validate.index(key[1], n_layers, name=f"cache[{key[0]!r}, layer]", what="layer")
            key = (key[0], layer, *key[2:])
        name = get_act_name(*key)
        if len(key) == 3 and key[2] is not None:
            self._check_layer_type(key, name)
        return self._lookup(name, key)

    @staticmethod
    def _check_layer_type(key: tuple, name: str) -> None:
        """TL's get_act_name forces `attn` / `mlp` for the names that live there, ignoring the layer_type given:
        a wrong one (cache["pattern", 0, "ln1"]) is refused rather than dropped."""
        alias = {"a": "attn", "attention": "attn", "m": "mlp", "b": "", "block": "", "blocks": ""}
        given = alias.get(key[2], key[2])
        if not isinstance(given, str) or (given and f".{given}." not in name):
            raise ArgumentTypeError(f"cache[{key!r}]: layer_type={key[2]!r} is not where {key[0]!r} lives ({name!r}); "
                                    f"use cache[{key[0]!r}, {key[1]!r}] or the full hook name.", argument="key",
                                    value=key, allowed=f"the layer type in {name!r}, or none")

    def _lookup(self, name: str, key: Any) -> Tensor:
        if name in self.cache_dict:
            return self.cache_dict[name]
        cached = list(self.cache_dict)
        close = difflib.get_close_matches(name, cached, n=3, cutoff=0.5)
        hooks = getattr(self.model, "hook_dict", {})
        why = ("the model has this hook point but it was not cached (names_filter / cache=...)" if name in hooks
               else "the model has no hook point of that name")
        hint = f" Nearest cached: {', '.join(close)}." if close else f" Cached: {len(cached)} name(s)."
        raise HookNameError(f"cache[{key!r}] -> {name!r}: {why}.{hint} List them with `list(cache.keys())`.")

    def _resid_layer(self, layer: Any, helper: str) -> Any:
        """TL's `layer` for the residual helpers: None, -1 (both the final residual) or an int in [0, n_layers]."""
        n = self.model.cfg.n_layers
        is_int = isinstance(layer, numbers.Integral) and not isinstance(layer, bool)
        if layer is None or (is_int and (layer == -1 or 0 <= layer <= n)):
            return None if layer is None else int(layer)  # TL asserts a Python int
        if not is_int:
            raise ArgumentTypeError(f"{helper}(layer={validate.describe(layer)}) is invalid: expected None or an "
                                    f"int in [0, {n}] (or -1).", argument="layer", value=layer,
                                    allowed=f"None, -1 or an int in [0, {n}]")
        raise OutOfRangeError(f"{helper}(layer={layer}) is out of range: expected None or -1 (the final residual, "
                              f"= {n}) or an int in [0, {n}] for this {n}-layer model.", argument="layer",
                              value=layer, allowed=f"None, -1 or an int in [0, {n}]")

    def _sizes(self) -> dict[str, int | None]:
        """Axis lengths the ``*_slice`` arguments index: positions and batch from a residual-stream tensor."""
        resid = next((v for k, v in self.cache_dict.items()
                      if k.endswith(("hook_resid_pre", "hook_resid_post", "hook_resid_mid", "hook_embed"))), None)
        pos = None if resid is None else int(resid.shape[-2])
        batch = None if resid is None or not self.has_batch_dim else int(resid.shape[0])
        return {"pos_slice": pos, "batch_slice": batch, "neuron_slice": getattr(self.model.cfg, "d_mlp", None)}

    def _checked(self, helper: str, args: tuple, kwargs: dict, layer: str | None = "layer") -> dict[str, Any]:
        """`helper`'s arguments by name, each checked (`mdm_lens.cache_args`); `layer` as the residual helpers
        take it (None, -1 or [0, n_layers]) when `layer` names it."""
        arguments = cache_args.bind(getattr(ActivationCache, helper), helper, args, kwargs)
        batch_slice = arguments.get("batch_slice")
        if isinstance(batch_slice, Slice) and batch_slice.mode == "identity":  # TL's own internal calls
            batch_slice = None
        if batch_slice is not None and not self.has_batch_dim:
            raise ArgumentError(f"{helper}(batch_slice={validate.describe(arguments['batch_slice'])}): this cache "
                                "has no batch axis (remove_batch_dim=True).", argument="batch_slice",
                                value=arguments["batch_slice"], allowed="None")
        cache_args.check_common(arguments, helper, self._sizes())
        if layer is not None and layer in arguments:
            arguments[layer] = self._resid_layer(arguments[layer], helper)
        return arguments

    def _supported(self, helper: str, arguments: dict[str, Any] | None = None) -> None:
        """Refuse a helper whose TL math does not hold for this model (`model.unsupported_cache_helpers`: helper →
        why; "name(apply_ln=True)" entries refuse only that form), naming the helpers that do."""
        refused: dict[str, str] = getattr(self.model, "unsupported_cache_helpers", {})
        key = helper
        if arguments is not None and arguments.get("apply_ln"):
            key = f"{helper}(apply_ln=True)"
        if key not in refused:
            return
        ok = getattr(self.model, "supported_cache_helpers", "")
        raise ArgumentError(f"cache.{key} is not defined for a {type(self.model).__name__} cache: {refused[key]}. "
                            f"Supported here: {ok}.", argument=helper, value=key, allowed=ok)

    def accumulated_resid(self, *args: Any, **kwargs: Any) -> Any:
        arguments = self._checked("accumulated_resid", args, kwargs)
        self._supported("accumulated_resid", arguments)
        return super().accumulated_resid(**arguments)

    def decompose_resid(self, *args: Any, **kwargs: Any) -> Any:
        """TL's `decompose_resid`; `mode` must be "all", "attn" or "mlp" (TL reads any other value as "all")."""
        arguments = self._checked("decompose_resid", args, kwargs)
        self._supported("decompose_resid", arguments)
        return super().decompose_resid(**arguments)

    def _dense_neurons(self, helper: str, layers: range, argument: str, value: Any) -> None:
        """Neurons (`mlp.hook_post`) exist on dense MLP layers only: an MoE layer among `layers` is refused saying
        so, rather than as a missing hook the caller never named."""
        moe = self.model.cfg.extra.get("moe_layers") or []
        hit = [i for i in layers if i < len(moe) and moe[i]]
        if hit:
            dense = [i for i in range(len(moe)) if not moe[i]]
            raise ArgumentError(f"cache.{helper}: neurons are not defined on MoE layer(s) {hit} (each routed expert "
                                "has its own, under blocks.{l}.mlp.experts.{e}.hook_post); pass expand_neurons=False "
                                f"or a layer bound below the first MoE layer (dense layers: {dense}).",
                                argument=argument, value=value, allowed=f"layers without MoE: {dense}")

    def get_full_resid_decomposition(self, *args: Any, **kwargs: Any) -> Any:
        self._supported("get_full_resid_decomposition")
        arguments = self._checked("get_full_resid_decomposition", args, kwargs)
        if arguments.get("expand_neurons", True):
            top = arguments.get("layer")  # None / -1: every layer (TL)
            n = self.model.cfg.n_layers if top in (None, -1) else top
            self._dense_neurons("get_full_resid_decomposition", range(n), "expand_neurons", True)
        return super().get_full_resid_decomposition(**arguments)

    def stack_head_results(self, *args: Any, **kwargs: Any) -> Any:
        self._supported("stack_head_results")
        return super().stack_head_results(**self._checked("stack_head_results", args, kwargs))

    def stack_neuron_results(self, *args: Any, **kwargs: Any) -> Any:
        self._supported("stack_neuron_results")
        arguments = self._checked("stack_neuron_results", args, kwargs)
        top = arguments.get("layer")  # None / -1: every layer (TL)
        self._dense_neurons("stack_neuron_results", range(self.model.cfg.n_layers if top in (None, -1) else top),
                            "layer", top)
        return super().stack_neuron_results(**arguments)

    def get_neuron_results(self, *args: Any, **kwargs: Any) -> Any:
        self._supported("get_neuron_results")
        arguments = self._checked("get_neuron_results", args, kwargs, layer=None)
        arguments["layer"] = validate.index(arguments.get("layer"), self.model.cfg.n_layers, name="layer",
                                            what="layer")
        self._dense_neurons("get_neuron_results", range(arguments["layer"], arguments["layer"] + 1), "layer",
                            arguments["layer"])
        return super().get_neuron_results(**arguments)

    def apply_ln_to_stack(self, *args: Any, **kwargs: Any) -> Any:
        """TL's helper with one meaning of "apply the norm" in every mode: `x / scale`, no weight, as
        `decompose_resid(apply_ln=True)` and `logit_attrs` divide, because `model.tokens_to_residual_directions`
        carries the final norm's weight while it is unfolded. TL 4's `recompute_ln=True` (which its
        `accumulated_resid(apply_ln=True)` uses at the final layer) runs `ln_final` itself, weight included: here the
        statistics are recomputed per component the same way, and the weight is left to the directions (else DLA on
        a logit-lens stack counted it twice)."""
        self._supported("apply_ln_to_stack")
        arguments = self._checked("apply_ln_to_stack", args, kwargs)
        layer = arguments.get("layer")
        if arguments.get("recompute_ln") and layer in (None, -1, self.model.cfg.n_layers) \
                and hasattr(self.model.ln_final, "normalize"):
            stack = arguments["residual_stack"]
            if arguments.get("has_batch_dim", True):
                bs = arguments.get("batch_slice")
                stack = (bs if isinstance(bs, Slice) else Slice(bs)).apply(stack, dim=1)
            return self.model.ln_final.normalize(stack)
        self._check_stack_positions(arguments, "apply_ln_to_stack")
        return super().apply_ln_to_stack(**arguments)

    def logit_lens(self, *args: Any, **kwargs: Any) -> Any:
        """TransformerLens 4's one-call logit lens is built for its TransformerBridge readout (the final norm module
        with its weight, then W_U): refused here by name, with the two ways this library gives the same numbers."""
        raise UnsupportedAttributeError(
            "cache.logit_lens (TransformerLens 4's one-call lens for TransformerBridge models) is not supported on a "
            "HookedMDM cache. Per layer and denoising step: mdm_lens.lens (lens.logit.lens_logits; "
            "lens.trace.lens_trace over a generate run); on this cache: cache.accumulated_resid(apply_ln=True) "
            "dotted with model.tokens_to_residual_directions(tokens) (plus b_U) is each layer's logit-lens logit.",
            argument="logit_lens", value="cache.logit_lens",
            allowed="mdm_lens.lens, or accumulated_resid(apply_ln=True)")

    def _check_stack_positions(self, arguments: dict, helper: str) -> None:
        """The stack's [batch, pos] axes must be the final norm's scale's after `batch_slice` / `pos_slice`: TL
        divides by it through broadcasting, so a stack sliced one way and a scale sliced another (or a batch of 3
        on a batch-1 cache) give numbers of no position at all."""
        stack = arguments.get("residual_stack")
        name = "ln_final.hook_scale"
        if not isinstance(stack, Tensor) or name not in self.cache_dict:
            return
        as_slice = lambda v: v if isinstance(v, Slice) else Slice(v)  # noqa: E731 (TL takes both forms)
        scale = as_slice(arguments.get("pos_slice")).apply(self.cache_dict[name], dim=-2)
        if self.has_batch_dim:
            scale = as_slice(arguments.get("batch_slice")).apply(scale, dim=0)
        want, got = tuple(scale.shape[:-1]), tuple(stack.shape[1:-1])
        if got != want and arguments.get("has_batch_dim") is False and self.has_batch_dim:
            # TL's keyword for a stack without its batch axis; this cache keeps one, so say which argument
            raise ArgumentError(f"{helper}(has_batch_dim=False): this cache has a batch axis, so the stack keeps it "
                                f"too (here [batch, pos] = {want}); index the batch with batch_slice= instead of "
                                "dropping the axis, and leave has_batch_dim at its default.",
                                argument="has_batch_dim", value=False, allowed="True (the default) on this cache")
        if got != want:
            raise ArgumentError(f"{helper}: residual_stack of shape {tuple(stack.shape)} has [batch, pos] axes {got}, "
                                f"but the cached final-norm scale after pos_slice={arguments.get('pos_slice')!r} / "
                                f"batch_slice={arguments.get('batch_slice')!r} has {want}: slice the stack and pass "
                                "the same pos_slice / batch_slice here (e.g. pos_slice=-1 for a last-position stack).",
                                argument="pos_slice", value=arguments.get("pos_slice"),
                                allowed=f"slices giving [batch, pos] = {got}")

    def stack_activation(self, *args: Any, **kwargs: Any) -> Tensor:
        """TL's stack over layers [0, layer) with `layer` checked as the residual helpers check it (an exclusive
        bound in [0, n_layers], or -1 / None for all): TL's loop would fail at layer n_layers naming a 4 nobody passed."""
        return super().stack_activation(**self._checked("stack_activation", args, kwargs))

    def apply_slice_to_batch_dim(self, *args: Any, **kwargs: Any) -> Any:
        return super().apply_slice_to_batch_dim(**self._checked("apply_slice_to_batch_dim", args, kwargs))

    def logit_attrs(self, residual_stack: Any, tokens: Any, incorrect_tokens: Any = None, *args: Any,
                    **kwargs: Any) -> Tensor:
        """TL's logit attributions, with the stack checked first, every argument checked (slices against the
        cached run), `incorrect_tokens` shaped like `tokens`, and a shape mismatch between the stack and the
        tokens named (TL lets torch's broadcasting fail with a bare ``RuntimeError`` deep inside)."""
        self._supported("logit_attrs")
        d_model = self.model.cfg.d_model
        validate.tensor(residual_stack, name="residual_stack", dtype="float")
        if residual_stack.ndim < 2 or residual_stack.shape[-1] != d_model:
            raise ArgumentError(f"residual_stack has shape {tuple(residual_stack.shape)}: expected [components, "
                                f"*batch_and_pos, d_model={d_model}] (e.g. from decompose_resid).",
                                argument="residual_stack", value=residual_stack,
                                allowed=f"[components, *batch_and_pos, {d_model}]")
        tokens = validate.id_tensor(tokens, name="tokens")
        incorrect_tokens = validate.id_tensor(incorrect_tokens, name="incorrect_tokens")
        cache_args.check_token_shapes(tokens, incorrect_tokens)
        arguments = self._checked("logit_attrs", (residual_stack, tokens, incorrect_tokens, *args), kwargs, None)
        self._check_stack_positions(arguments, "logit_attrs")
        try:
            return super().logit_attrs(**arguments)
        except RuntimeError as e:
            if "size of tensor" not in str(e) and "must match" not in str(e):
                raise
            shape = tuple(getattr(tokens, "shape", ()))
            raise ArgumentError(f"logit_attrs: tokens of shape {shape} do not line up with residual_stack of shape "
                                f"{tuple(residual_stack.shape)} (after pos_slice/batch_slice): pass one id, [batch], "
                                "[pos], [1, pos] or [batch, pos] ids sliced like the stack.", argument="tokens",
                                value=tokens, allowed="ids shaped like the stack's batch/pos axes") from e
