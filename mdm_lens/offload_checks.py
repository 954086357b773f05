"""Refusals for operations on weights that a device_map offloaded (`mdm_lens.loading.placement`).

accelerate keeps an offloaded module's parameters on the `meta` device and loads them only for the module's own
forward. A TransformerLens weight view of such a module (`blocks[1].attn.W_Q`, `model.OV`) would otherwise fail
inside torch ("Tensor on device meta…"), an in-place edit through it would be lost, and weight processing
(`fold_ln`) would drop a norm weight without folding it into the offloaded matrices, silently changing the
model. Each of these raises `OffloadedWeightsError`, naming the modules and how to load them resident.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from torch import nn

from mdm_lens.errors import OffloadedWeightsError

HOW = ("Load them resident: from_pretrained without a device_map (one device), or a device_map / max_memory that "
       "places every module on a device (e.g. device_map={'': 'cpu'}).")


def _is_offloaded(module: nn.Module, recurse: bool) -> bool:
    tensors = list(module.parameters(recurse=recurse)) + list(module.buffers(recurse=recurse))
    return any(t.is_meta for t in tensors)


def offloaded_modules(model: nn.Module) -> list[str]:
    """The `hf_device_map` entries (e.g. "blocks.1") whose weights are offloaded (on meta), in map order."""
    device_map = getattr(model, "hf_device_map", None) or {}
    out = []
    for name, where in device_map.items():
        module = model.get_submodule(name) if name else model
        if _is_offloaded(module, recurse=True):
            out.append(f"{name or '<model>'} ({where})")
    return out


def require_resident(model: nn.Module, what: str) -> None:
    """Raise `OffloadedWeightsError` if any module of `model` is offloaded; `what` names the operation."""
    names = offloaded_modules(model)
    if names:
        raise OffloadedWeightsError(f"{what} needs every weight resident, and this model's device_map offloaded "
                                    f"{', '.join(names)} (their weights are on 'meta' outside a forward). {HOW}",
                                    argument="model", value=names, allowed="a model with no offloaded module")


def mark_offloaded(model: nn.Module) -> None:
    """Record each offloaded module's path on it (`_offloaded_as`), so that its own weight views can name it."""
    for name, module in model.named_modules():
        if _is_offloaded(module, recurse=False):
            module._offloaded_as = name


def _check_part(obj: nn.Module, part: str | None, view: str) -> None:
    module = obj.get_submodule(part) if part else obj
    if _is_offloaded(module, recurse=False):
        where = getattr(module, "_offloaded_as", part or type(module).__name__)
        raise OffloadedWeightsError(f"{view} reads the weights of {where!r}, which the device_map offloaded (they are "
                                    f"on 'meta' outside its forward; an in-place edit would be lost). {HOW}",
                                    argument="model", value=where, allowed="a resident module")


def guard_views(cls: type, names: list[str], part: str | None = None) -> None:
    """Wrap the properties / methods `names` of `cls` so that they first check that the module's own weights
    (or those of its submodule `part`) are resident."""
    for name in names:
        attr = cls.__dict__[name]
        if isinstance(attr, property):
            setattr(cls, name, property(_guarded(attr.fget, name, part), doc=attr.__doc__))
        else:
            setattr(cls, name, _guarded(attr, name, part))


def _guarded(fn: Callable, name: str, part: str | None) -> Callable:
    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        _check_part(self, part, name)
        return fn(self, *args, **kwargs)
    return wrapper
