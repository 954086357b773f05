"""The checked TransformerLens hook surface shared by `HookedMDM` and the transformers-native bridge.

Both are `HookedRootModule`s; this base makes every way in (`add_hook`, `hooks()`, `run_with_hooks`,
`run_with_cache`) check hook names and argument types before a hook is added, so a typo raises
`HookNameError` with the nearest names instead of silently caching nothing."""

from __future__ import annotations

import difflib
import fnmatch
import functools
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence, Union

import torch
from torch import Tensor
from transformer_lens import ActivationCache, HookedRootModule

from mdm_lens import validate
from mdm_lens.cache import MDMActivationCache
from mdm_lens.errors import ArgumentError, ArgumentTypeError, HookNameError, InputError

NamesFilter = Union[None, str, Sequence[str], Callable[[str], bool]]


def hook_list(hooks: Any, name: str) -> list[tuple[Any, Callable]]:
    """TL's `[(name_or_filter, fn), ...]`; a lone pair (a common slip) is an error, not a silent char-split."""
    if not isinstance(hooks, (list, tuple)):
        raise ArgumentTypeError(f"{name}={validate.describe(hooks)} is invalid: expected a list of (hook name, "
                                f"function) pairs.", argument=name, value=hooks, allowed="a list of pairs")
    if len(hooks) == 2 and isinstance(hooks[0], str) and callable(hooks[1]):
        raise ArgumentTypeError(f"{name}={validate.describe(hooks)} is one pair, not a list of pairs: write "
                                f"{name}=[(name, fn)].", argument=name, value=hooks, allowed="a list of pairs")
    out = []
    for i, pair in enumerate(hooks):
        pair = _step_hook_pair(pair, f"{name}[{i}]")
        ok = isinstance(pair, (list, tuple)) and len(pair) == 2 and (
            isinstance(pair[0], str) or callable(pair[0]) or _names(pair[0])) and callable(pair[1])
        if not ok:
            raise ArgumentTypeError(f"{name}[{i}]={validate.describe(pair)} is invalid: expected a pair (hook name or "
                                    "filter function or list of names, hook function).", argument=f"{name}[{i}]",
                                    value=pair, allowed="a (str | list of str | callable, callable) pair")
        out.append((pair[0], pair[1]))
    return out


def _step_hook_pair(pair: Any, name: str) -> Any:
    """A `StepHook` (``sae_hook(...)``, ``at_steps(fn, name=...)``; duck-typed: hooks/ imports this module's users)
    outside `generate`: a plain forward has no denoising step, so an all-steps hook fires on every forward and a
    step-bound one is refused (it would otherwise fire at no step or at every one, both silently wrong)."""
    if isinstance(pair, (list, tuple)) and len(pair) == 2 and _bound(pair[1]):  # (name, at_steps(fn, steps))
        _refuse_steps(pair[1].when, name)
        return (pair[0], pair[1].fn)
    when = getattr(pair, "when", None)
    if isinstance(pair, (list, tuple)) or when is None or not hasattr(pair, "fn") or not hasattr(pair, "name"):
        return pair
    _refuse_steps(when, name)
    return (pair.name, pair.fn)


def _bound(fn: Any) -> bool:
    """A `BoundHook` (`at_steps(fn, steps)` without a name), duck-typed: a callable with `.fn` and `.when`."""
    return callable(fn) and hasattr(fn, "fn") and hasattr(fn, "when") and not hasattr(fn, "name")


def _refuse_steps(when: Any, name: str) -> None:
    if when != type(when)():  # Steps() is every step
        raise ArgumentError(f"{name} is bound to denoising steps ({when}); a plain forward has no step. Pass it to "
                            "model.generate(..., fwd_hooks=[...]) (or out.replay), or drop the steps to hook every "
                            "forward.", argument=name, value=when,
                            allowed="a hook bound to every step (no @ steps(...)) outside generate")


GLOB_CHARS = "*?["


def is_glob(name: Any) -> bool:
    """A hook name written as a shell glob ("blocks.*.attn.hook_pattern")."""
    return isinstance(name, str) and any(c in name for c in GLOB_CHARS)


def _names(value: Any) -> bool:
    """A non-empty list / tuple of hook names (or globs): one hook for each hook point they name."""
    return isinstance(value, (list, tuple)) and len(value) > 0 and all(isinstance(n, str) for n in value)


def _any_match(name: str, wanted: tuple) -> bool:
    return any(w(name) if callable(w) else w == name for w in wanted)


def _while_live(fn: Callable, live: list[bool]) -> Callable:
    """A backward hook that runs `fn` only while its `hooks()` context has not reset it (`live[0]`)."""
    def hook(grad: Any, hook: Any = None) -> Any:
        return fn(grad, hook=hook) if live[0] else None
    return hook


def _check_incl_bwd(model: Any, kwargs: dict[str, Any]) -> None:
    """TL's `incl_bwd=True` calls `.backward()` on the forward's output, which needs one scalar: refused up front
    for logits, per-token losses and `return_type="both"` (a tuple), instead of a raw error after the forward."""
    if not validate.boolean(kwargs.get("incl_bwd", False), name="incl_bwd"):
        return
    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        inference = torch.is_inference_mode_enabled()  # enable_grad() cannot undo inference_mode
        mode, hint = ("torch.inference_mode()", "") if inference else ("torch.no_grad()",
                                                                      " (or inside `with torch.enable_grad():`)")
        raise InputError(f"incl_bwd=True needs gradients, but run_with_cache was called under {mode}: call it "
                         f"outside that block{hint}.", argument="incl_bwd",
                         value=True, allowed="incl_bwd=False under no_grad / inference_mode")
    rt, per_token = kwargs.get("return_type", "logits"), kwargs.get("loss_per_token", False)
    if getattr(model, "readout_hook", None) is not None and rt != "loss":  # HookedDDiT: its forward has no loss
        raise InputError(f"incl_bwd=True needs a scalar output to call backward() on, and a DDiT forward returns "
                         f"logits (return_type={rt!r}; it has no 'loss'): run run_with_hooks(..., "
                         "reset_hooks_end=False) with your own scalar and call .backward() on it.",
                         argument="incl_bwd", value=True, allowed="incl_bwd=False on a DDiT model")
    if rt != "loss" or per_token is not False:
        got = f"return_type={rt!r}" + (f", loss_per_token={per_token!r}" if per_token is not False else "")
        raise InputError(f"incl_bwd=True needs a scalar output to call backward() on, got {got}: pass "
                         "return_type='loss' without loss_per_token (or call .backward() on your own scalar "
                         "inside run_with_hooks).", argument="incl_bwd", value=got,
                         allowed="return_type='loss' (scalar) with incl_bwd=True")


def shape_checked(fn: Callable) -> Callable:
    """`fn` as a TL forward hook whose return value (if any) must be a tensor of the hooked activation's shape:
    a hook returning the wrong shape raises `InputError` naming the hook point and both shapes, instead of an
    unclear error deep in the next torch op (or a silent broadcast)."""
    if getattr(fn, "_mdm_shape_checked", False):
        return fn

    def hook_fn(tensor: Any, hook: Any) -> Any:
        out = fn(tensor, hook=hook)
        if out is None or not isinstance(tensor, Tensor):
            return out
        where = getattr(hook, "name", None) or "a hook point"
        if not isinstance(out, Tensor):
            raise InputError(f"the hook on {where} returned {validate.describe(out)}; a forward hook returns None "
                             f"or a tensor of the activation's shape {tuple(tensor.shape)}.", argument="fwd_hooks",
                             value=type(out).__name__, allowed=f"None or a tensor of shape {tuple(tensor.shape)}")
        if out.shape != tensor.shape:
            raise InputError(f"the hook on {where} returned shape {tuple(out.shape)}, expected the activation's "
                             f"shape {tuple(tensor.shape)} (a hook that edits must return a tensor of the same "
                             "shape).", argument="fwd_hooks", value=tuple(out.shape),
                             allowed=f"shape {tuple(tensor.shape)}")
        # another dtype (r.double()) or device would fail in the next matmul with a raw torch error far from the
        # hook (or, for an int activation, index with truncated values); the hook must cast back itself
        for what, got, want in (("dtype", out.dtype, tensor.dtype), ("device", out.device, tensor.device)):
            if got != want:
                raise InputError(f"the hook on {where} returned a tensor of {what} {got}, expected the activation's "
                                 f"{what} {want} (a hook that edits must return the same {what}: cast back with "
                                 f".to({want if what == 'dtype' else repr(str(want))})).", argument="fwd_hooks",
                                 value=str(got),
                                 allowed=f"{what} {want}")
        _check_index_range(out, hook, where)
        return out

    hook_fn._mdm_shape_checked = True  # type: ignore[attr-defined]
    hook_fn.__repr__ = fn.__repr__  # type: ignore[method-assign]  (TL names its torch hook after it)
    return hook_fn


def bound_indices(point: Any, n: int) -> None:
    """Mark a hook point whose activation holds indices into a table of `n` rows (MoE expert ids): a hook's
    returned ids are then checked against [0, n), as the model itself would only fail with a raw
    "index out of bounds" (or, for a negative id, silently read another expert)."""
    point.__dict__["index_range"] = int(n)  # plain attribute: not a submodule, not in the state dict


def _check_index_range(out: Tensor, hook: Any, where: str) -> None:
    n = getattr(hook, "index_range", None)
    if n is None or out.numel() == 0:
        return
    lo, hi = int(out.min()), int(out.max())
    if lo < 0 or hi >= n:
        raise InputError(f"the hook on {where} returned ids in [{lo}, {hi}]; expected expert ids in [0, {n}) "
                         f"(this layer has {n} experts).", argument="fwd_hooks", value=(lo, hi),
                         allowed=f"ids in [0, {n})")


class CheckedHookSurface(HookedRootModule):
    """TL's hook machinery with names and arguments checked first. Subclasses set `hook_name_hint` (how
    their names are built) and may extend `check_hook_name` (e.g. opt-in hook points)."""

    hook_name_hint = "names follow TransformerLens, e.g. 'blocks.0.attn.hook_pattern'."

    def check_hook_name(self, name: str) -> None:
        if name not in self.hook_dict:
            close = difflib.get_close_matches(name, list(self.hook_dict), n=3, cutoff=0.6)
            hint = f" Did you mean {', '.join(close)}?" if close else ""
            raise HookNameError(f"no hook point named {name!r}.{hint} List them with `list(model.hook_dict)`; "
                                f"{self.hook_name_hint}")

    def name_filter(self, name: Any) -> Any:
        """A hook name as TL takes it: a checked name, or for a shell glob ("blocks.*.hook_resid_pre", as
        `generate` takes) or a list of names / globs the filter function TL applies to every hook point; a glob
        matching none is an error."""
        if _names(name):
            wanted = tuple(self.name_filter(n) for n in name)
            return functools.partial(_any_match, wanted=wanted)
        if not is_glob(name):
            self.check_hook_name(name)
            return name
        if not fnmatch.filter(list(self.hook_dict), name):
            raise HookNameError(f"the glob {name!r} matches no hook point; list them with `list(model.hook_dict)`; "
                                f"{self.hook_name_hint}")
        return functools.partial(fnmatch.fnmatchcase, pat=name)

    def add_hook(self, name, hook, dir="fwd", is_permanent=False, level=None, prepend=False) -> None:  # type: ignore[override]
        validate.choice(dir, ("fwd", "bwd"), name="dir")
        if isinstance(name, str) or _names(name):
            name = self.name_filter(name)
        elif not callable(name):
            raise ArgumentTypeError(f"hook name {validate.describe(name)} is invalid: expected a hook name (str), a "
                                    "non-empty list of names, or a filter function on names.", argument="name",
                                    value=name, allowed="a str, a list of str or a callable")
        if not callable(hook):  # TL would store it and fail inside the next forward, naming no hook point
            raise ArgumentTypeError(f"hook={validate.describe(hook)} is invalid: expected a function "
                                    "fn(tensor, hook).", argument="hook", value=hook, allowed="a callable")
        if dir == "fwd":
            hook = shape_checked(hook)
        super().add_hook(name, hook, dir=dir, is_permanent=is_permanent, level=level, prepend=prepend)

    def _enable_hook(self, name: Any, hook: Callable, dir: Any) -> None:  # type: ignore[override]
        # the way `hooks()` / `run_with_hooks` add theirs (not through `add_hook`)
        super()._enable_hook(name, shape_checked(hook) if dir == "fwd" else hook, dir)

    def to(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """`nn.Module.to`, refusing a device this machine does not have (``"cuda"`` without CUDA) or ``"meta"`` with
        a typed error before anything moves; a dtype given updates ``cfg.dtype``."""
        target = kwargs.get("device", args[0] if args else None)
        if isinstance(target, (str, torch.device)):
            # 'meta' keeps shapes only: every later forward would fail inside torch (from_pretrained refuses it too)
            validate.storage_device(target, name="device", what="model's weights")
        moved = super().to(*args, **kwargs)
        dtype = torch._C._nn._parse_to(*args, **kwargs)[1]
        # as TL's move_to_and_update_config: cfg.dtype is what repr, save_pretrained and the memory plans read
        if dtype is not None and dtype.is_floating_point and getattr(self, "cfg", None) is not None:
            self.cfg.dtype = dtype
        return moved

    def half(self) -> Any:  # type: ignore[override]
        return self.to(torch.float16)

    def bfloat16(self) -> Any:  # type: ignore[override]
        return self.to(torch.bfloat16)

    def float(self) -> Any:  # type: ignore[override]
        return self.to(torch.float32)

    def double(self) -> Any:  # type: ignore[override]
        return self.to(torch.float64)

    def cuda(self, device: Any = None) -> Any:  # type: ignore[override]
        validate.device("cuda" if device is None else (f"cuda:{device}" if isinstance(device, int) else device),
                        name="device")
        return super().cuda(device)

    # TL resets every hook point after each `hooks()` / `run_with_cache`; on a hook point with nothing to
    # remove that is still two `nn.Module.__setattr__` calls (fresh lists, fresh ctx dict). With ~300
    # hook points that was ~3% of a bridge forward at 2 threads, so only the hook points that hold
    # something are touched; the result is the same state TL leaves.
    def remove_all_hook_fns(self, direction: str = "both", including_permanent: bool = False,  # type: ignore[override]
                            level: int | None = None) -> None:
        validate.choice(direction, ("fwd", "bwd", "both"), name="direction")
        for hp in self.hook_dict.values():
            if hp.fwd_hooks or hp.bwd_hooks:
                hp.remove_hooks(direction, including_permanent=including_permanent, level=level)

    def clear_contexts(self) -> None:  # type: ignore[override]
        for hp in self.hook_dict.values():
            if hp.ctx:
                hp.clear_context()

    def _enable_hook_with_name(self, name: str, hook: Callable, dir) -> None:  # type: ignore[override]
        self.check_hook_name(name)
        super()._enable_hook_with_name(name, hook, dir)

    @contextmanager
    def hooks(self, fwd_hooks: Any = [], bwd_hooks: Any = [], reset_hooks_end: bool = True,  # noqa: B006 (TL's signature)
              clear_contexts: bool = False) -> Iterator[Any]:
        """TL's `hooks()` context manager, with the hook lists checked before any hook is added."""
        fwd_hooks = hook_list(fwd_hooks, "fwd_hooks")
        bwd_hooks = hook_list(bwd_hooks, "bwd_hooks")
        validate.boolean(reset_hooks_end, name="reset_hooks_end")
        validate.boolean(clear_contexts, name="clear_contexts")
        fwd_hooks = [(n if callable(n) else self.name_filter(n), fn) for n, fn in fwd_hooks]
        bwd_hooks = [(n if callable(n) else self.name_filter(n), fn) for n, fn in bwd_hooks]
        # PyTorch captures a module's full backward hooks in the graph at forward time, so a reset alone would not
        # stop a later .backward() from running them (and applying their edits); once reset they do nothing
        live = [True]
        if reset_hooks_end:
            bwd_hooks = [(name, _while_live(fn, live)) for name, fn in bwd_hooks]
        try:
            with super().hooks(fwd_hooks, bwd_hooks, reset_hooks_end, clear_contexts) as model:
                yield model
        finally:
            live[0] = not reset_hooks_end

    def run_with_hooks(self, *model_args: Any, fwd_hooks: Any = [], bwd_hooks: Any = [],  # noqa: B006 (TL's)
                       reset_hooks_end: bool = True, clear_contexts: bool = False, **model_kwargs: Any) -> Any:
        """TL's `run_with_hooks`; backward hooks under `torch.no_grad()` / `inference_mode()` are refused (the
        output has no graph, so no backward could ever reach them)."""
        if hook_list(bwd_hooks, "bwd_hooks") and (not torch.is_grad_enabled() or torch.is_inference_mode_enabled()):
            mode = "torch.inference_mode()" if torch.is_inference_mode_enabled() else "torch.no_grad()"
            raise InputError(f"bwd_hooks were given, but run_with_hooks was called under {mode}: the output has no "
                             "graph, so they could never run. Call it outside that block.", argument="bwd_hooks",
                             value=mode, allowed="no bwd_hooks under no_grad / inference_mode")
        return super().run_with_hooks(*model_args, fwd_hooks=fwd_hooks, bwd_hooks=bwd_hooks,
                                      reset_hooks_end=reset_hooks_end, clear_contexts=clear_contexts, **model_kwargs)

    def _check_names_filter(self, names_filter: NamesFilter) -> NamesFilter:
        if names_filter is None or callable(names_filter):
            return names_filter
        if isinstance(names_filter, str):
            return self.name_filter(names_filter)
        if isinstance(names_filter, (list, tuple)) and not names_filter:
            raise ArgumentError("names_filter=[] selects no hook point, so nothing would be cached; pass None for "
                                "every hook point, or at least one name.", argument="names_filter",
                                value=names_filter, allowed="None or a non-empty list of names")
        if _names(names_filter):
            wanted = [self.name_filter(n) for n in names_filter]
            return wanted if not any(callable(w) for w in wanted) else self.name_filter(names_filter)
        raise ArgumentTypeError(f"names_filter={validate.describe(names_filter)} is invalid: expected None, a hook "
                                "name, a list of hook names, or a function name -> bool.", argument="names_filter",
                                value=names_filter, allowed="None, str, list of str or callable")

    @staticmethod
    def _check_cache_placement(model_args: tuple, kwargs: dict) -> None:
        """TL's `pos_slice=` (checked against the tokens' positions, as the cache helpers check it: out of range is
        an error, not a silent cut) and `device=` (a device this machine has), before the forward."""
        from mdm_lens.cache_args import check_slice

        if kwargs.get("device") is not None:
            validate.storage_device(kwargs["device"], name="device")
        if kwargs.get("pos_slice") is not None:
            tokens = model_args[0] if model_args else kwargs.get("tokens", kwargs.get("input"))
            size = int(tokens.shape[-1]) if isinstance(tokens, Tensor) and tokens.ndim in (1, 2) else None
            check_slice(kwargs["pos_slice"], size, name="pos_slice", helper="run_with_cache")

    def run_with_cache(self, *model_args: Any, names_filter: NamesFilter = None, remove_batch_dim: bool = False,
                       return_cache_object: bool = True, **kwargs: Any) -> tuple[Any, ActivationCache]:
        """TL's `run_with_cache`, returning an `ActivationCache` (`MDMActivationCache`: a missing name or an
        out-of-range layer is a typed error naming what exists) (hook names are checked first)."""
        names_filter = self._check_names_filter(names_filter)
        validate.boolean(remove_batch_dim, name="remove_batch_dim")
        validate.boolean(return_cache_object, name="return_cache_object")
        _check_incl_bwd(self, kwargs)
        self._check_cache_placement(model_args, kwargs)
        if remove_batch_dim and model_args and isinstance(model_args[0], Tensor) and model_args[0].ndim == 2 \
                and model_args[0].shape[0] != 1:
            raise InputError(f"remove_batch_dim=True needs a batch of one; tokens have batch {model_args[0].shape[0]}.",
                             argument="remove_batch_dim", value=True, allowed="False for batches larger than 1")
        out, cache_dict = super().run_with_cache(*model_args, names_filter=names_filter,
                                                 remove_batch_dim=remove_batch_dim, **kwargs)
        if return_cache_object:
            return out, MDMActivationCache(cache_dict, self, has_batch_dim=not remove_batch_dim)
        return out, cache_dict
