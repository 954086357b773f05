"""Argument checks shared by the probes, on top of :mod:`mdm_lens.validate`.

Probes are shape-generic (any leading axes), so besides the plain helpers of ``validate`` they need:
a float tensor of at least some rank, a boolean mask whose last axis matches and whose leading axes
broadcast against the tensor it accompanies, and the NaN policy of a statistic (raise on NaN/inf at
the entries a probe actually uses, or treat such keys as invisible).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from mdm_lens import validate
from mdm_lens.errors import ArgumentError, ArgumentTypeError, NonFiniteError, OutOfRangeError

NAN_POLICIES: tuple[str, ...] = ("raise", "omit")


def float_tensor(x: Any, *, name: str, min_ndim: int = 1, square: bool = False) -> Tensor:
    """A non-empty float tensor with at least ``min_ndim`` axes (``square``: the last two are equal)."""
    validate.tensor(x, name=name, dtype="float")
    if x.ndim < min_ndim:
        raise ArgumentError(f"{name}={validate.describe(x)} is invalid: expected at least {min_ndim} dimensions.",
                            argument=name, value=x, allowed=f">= {min_ndim} dimensions")
    if square and x.shape[-1] != x.shape[-2]:
        raise ArgumentError(f"{name}={validate.describe(x)} is invalid: expected the last two axes to be equal "
                            "(a [query, key] pattern over the same positions).",
                            argument=name, value=x, allowed="shape [..., T, T]")
    return x


def int_tensor(x: Any, *, name: str, min_ndim: int = 1) -> Tensor:
    validate.tensor(x, name=name, dtype="int")
    if x.ndim < min_ndim:
        raise ArgumentError(f"{name}={validate.describe(x)} is invalid: expected at least {min_ndim} dimensions.",
                            argument=name, value=x, allowed=f">= {min_ndim} dimensions")
    return x


def mask(m: Any, *, name: str, size: int, against: Sequence[int] | None = None, allow_int: bool = True) -> Tensor | None:
    """None, or a bool (or 0/1 int) tensor whose last axis has ``size`` entries and whose shape broadcasts
    against ``against`` (the shape of the tensor it accompanies, mask axes right-aligned). Returns bool."""
    if m is None:
        return None
    if not isinstance(m, Tensor):
        raise ArgumentTypeError(f"{name}={validate.describe(m)} is invalid: expected a bool torch.Tensor.",
                                argument=name, value=m, allowed="a bool tensor")
    if m.dtype != torch.bool:
        if not allow_int or m.is_floating_point() or m.is_complex():
            raise ArgumentTypeError(f"{name}={validate.describe(m)} is invalid: expected a bool tensor.",
                                    argument=name, value=m, allowed="a bool tensor")
        if m.numel() and not bool(((m == 0) | (m == 1)).all()):
            raise ArgumentError(f"{name}={validate.describe(m)} is invalid: an integer mask must hold only 0 and 1.",
                                argument=name, value=m, allowed="0/1 values")
    if m.ndim == 0 or m.shape[-1] != size:
        raise ArgumentError(f"{name}={validate.describe(m)} is invalid: expected its last axis to have {size} "
                            "entries.", argument=name, value=m, allowed=f"shape [..., {size}]")
    if against is not None:
        try:
            torch.broadcast_shapes(tuple(m.shape), tuple(against))
        except RuntimeError:
            raise ArgumentError(f"{name}={validate.describe(m)} is invalid: it does not broadcast against shape "
                                f"{tuple(against)} (mask axes are right-aligned).", argument=name, value=m,
                                allowed=f"broadcastable to {tuple(against)}") from None
    return m.bool()


def nan_policy(policy: Any) -> str:
    return validate.choice(policy, NAN_POLICIES, name="nan_policy")


def finite_where(x: Tensor, used: Tensor | None, *, name: str, policy: str = "raise") -> None:
    """NonFiniteError when ``x`` holds NaN/inf at an entry in ``used`` (all entries when None), unless
    ``policy == "omit"``."""
    if policy == "omit":
        return
    bad = ~torch.isfinite(x)
    if used is not None:
        bad = bad & used
    if bool(bad.any()):
        n_nan = int((torch.isnan(x) & bad).sum())
        n_inf = int((torch.isinf(x) & bad).sum())
        raise NonFiniteError(
            f"{name}={validate.describe(x)} is invalid: expected finite values at the entries a probe uses "
            f"({n_nan} NaN and {n_inf} inf there); mark keys that do not exist as invisible (key_visible) or pass "
            "nan_policy='omit' to treat non-finite keys as invisible.",
            argument=name, value=x, allowed="finite values")


def shapes_broadcast(a: Tensor, b: Tensor, *, names: tuple[str, str]) -> tuple[int, ...]:
    try:
        return tuple(torch.broadcast_shapes(tuple(a.shape), tuple(b.shape)))
    except RuntimeError:
        raise ArgumentError(f"{names[1]} has shape {tuple(b.shape)}, which does not broadcast against {names[0]} of "
                            f"shape {tuple(a.shape)}.", argument=names[1], value=b,
                            allowed=f"broadcastable to {tuple(a.shape)}") from None


def optional_int(v: Any, *, name: str, min: int | None = None) -> int | None:
    return None if v is None else validate.integer(v, name=name, min=min)


# generate keywords a probe that runs `generate` itself sets on its own (and what to pass instead)
OWN_GENERATE = {"prompt": "the probe's own prompt argument is the prompt",
                "steps": "pass the probe's n_steps= for the number of denoising steps, and its own step selector "
                         "(steps= where it takes a list, step= where it acts at one step) for where it acts",
                # DiffusionGemma's spellings of the probe's own lengths: the probe always passes gen_length / steps
                # (its defaults when the caller gave none), and scores the answer over gen_length, so a second
                # spelling would either collide in the bridge or disagree with the positions the probe scores
                "max_new_tokens": "pass the probe's gen_length= instead (it is DiffusionGemma's max_new_tokens)",
                "max_denoising_steps": "pass the probe's n_steps= (or steps= where it takes one) instead: the total "
                                       "over all canvases, which DiffusionGemma runs as max_denoising_steps = "
                                       "n_steps / ceil(gen_length / canvas_length) per canvas",
                "max_length": "the probe sets the length from its gen_length= (DiffusionGemma's max_new_tokens)",
                "fwd_hooks": "the probe installs its own hooks on every run; hooks of yours would change what it "
                             "measures (run model.generate yourself to combine them)",
                "hook_steps": "the probe's runs take no hooks of yours",
                "record": "the probe returns its own result, not a run's records",
                "cache": "the probe returns its own result, not a run's cache"}


def own_generate_keywords(generate_kwargs: dict[str, Any], probe: Any, taken: Sequence[str] = (),
                          also: Sequence[Any] = ()) -> None:
    """Refuse generate keywords the probe sets itself (`OWN_GENERATE`, minus the ones it takes as its own
    arguments, `taken`): they collided inside `generate` (a raw "got multiple values" TypeError) or were silently
    dropped (`record=` / `cache=` whose results the probe never returns). `probe` a function (a public probe): a
    key that is no sampler setting and no `generate` argument is also refused, as a misspelt argument of the probe
    far more often than a sampler setting, naming the nearest of its own arguments (and of `also`'s, the
    functions it passes its keywords on to)."""
    name = probe if isinstance(probe, str) else probe.__name__
    for key in generate_kwargs:
        if key in OWN_GENERATE and key not in taken:
            raise ArgumentError(f"{name}({key}=...): {name} runs generate itself and sets {key}; "
                                f"{OWN_GENERATE[key]}.", argument=key, value=validate.describe(generate_kwargs[key]),
                                allowed=f"generate settings other than {sorted(k for k in OWN_GENERATE if k not in taken)}")
    if not isinstance(probe, str):
        unknown_keywords(generate_kwargs, probe, *also)


def unknown_keywords(kwargs: dict[str, Any], *probes: Any) -> None:
    """Refuse a key of `kwargs` (passed on to `generate`) that is no sampler setting and no `generate` argument,
    naming the probe `probes[0]` and the nearest argument of `probes` (see `own_generate_keywords`)."""
    import dataclasses
    import difflib
    import inspect

    from mdm_lens.diffusion.registry import Observation, all_settings

    known = all_settings() | {f.name for f in dataclasses.fields(Observation)} | {"sampler"}
    own = list(dict.fromkeys(p.name for fn in probes for p in inspect.signature(fn).parameters.values()
                             if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "model"))
    for key, value in kwargs.items():
        if key in known:
            continue
        near = difflib.get_close_matches(key, own, n=1) or difflib.get_close_matches(key, sorted(known), n=1)
        raise ArgumentTypeError(f"{probes[0].__name__}() got an unknown keyword {key}={validate.describe(value)}: "
                                "it is neither one of its arguments nor a sampler setting or generate() argument "
                                "(which it passes on)" + (f"; did you mean {near[0]}=?" if near else "."),
                                argument=key, value=value, allowed=f"its arguments {own}, or sampler settings")
