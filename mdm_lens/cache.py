"""`MDMActivationCache`: TransformerLens' `ActivationCache` whose lookups fail with typed errors.

TL's cache answers ``cache["pattern", 7]`` on a 4-layer model, or a name that was not cached, with a bare
``KeyError('blocks.7.attn.hook_pattern')``. Here an out-of-range layer raises `OutOfRangeError` naming the valid
range (negative layers count from the end, as in TL), and a missing name raises `HookNameError` (a `KeyError`,
so ``except KeyError`` still works) naming the nearest cached names and whether the model has that hook point at
all (then it was filtered out by ``names_filter``). Every other behaviour is TL's: it *is* an `ActivationCache`.
"""

from __future__ import annotations

import difflib
from typing import Any

from torch import Tensor
from transformer_lens import ActivationCache
from transformer_lens.utilities import get_act_name

from mdm_lens import validate
from mdm_lens.errors import ArgumentTypeError, HookNameError

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
        if len(key) > 1 and key[1] is not None:
            n_layers = self.model.cfg.n_layers
            layer = validate.index(key[1], n_layers, name=f"cache[{key[0]!r}, layer]", what="layer")
            key = (key[0], layer, *key[2:])
        return self._lookup(get_act_name(*key), key)

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
