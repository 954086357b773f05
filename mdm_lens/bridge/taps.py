"""`TapPoint`: a TransformerLens `HookPoint` that reads a transformers submodule's output (or input)
through a torch hook registered only while something hooks the point.

A torch forward hook on a module, even one that returns at once, sends every call of that module
down `nn.Module`'s slow dispatch path; with q/k norms, routers, embeddings and final norms tapped
that was ~1% of an unhooked bridge forward. A tap is registered on the first `add_hook` and removed
when the last hook goes, so an unhooked bridge runs transformers' modules untouched.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn
from transformer_lens.hook_points import HookPoint


class TapPoint(HookPoint):
    def __init__(self) -> None:
        super().__init__()
        # plain attributes (not registered with nn.Module): the module is transformers', not ours
        self.__dict__["_tap"] = None       # (module, torch hook fn, pre-hook?)
        self.__dict__["_handle"] = None

    def bind(self, module: nn.Module, fn: Callable[..., Any], pre: bool = False) -> None:
        """Tap `module` with `fn` (a torch forward hook, or forward pre-hook when `pre`) while hooked."""
        self.unbind()
        self.__dict__["_tap"] = (module, fn, pre)
        self._sync()

    def unbind(self) -> None:
        if self._handle is not None:
            self._handle.remove()
        self.__dict__["_handle"] = None
        self.__dict__["_tap"] = None

    def _sync(self) -> None:
        want = bool(self.fwd_hooks or self.bwd_hooks) and self._tap is not None
        if want and self._handle is None:
            module, fn, pre = self._tap
            register = module.register_forward_pre_hook if pre else module.register_forward_hook
            self.__dict__["_handle"] = register(fn)
        elif not want and self._handle is not None:
            self._handle.remove()
            self.__dict__["_handle"] = None

    def add_hook(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        handle = super().add_hook(*args, **kwargs)
        self._sync()
        return handle

    def remove_hooks(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        super().remove_hooks(*args, **kwargs)
        self._sync()
