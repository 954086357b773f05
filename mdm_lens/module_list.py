"""`nn.ModuleList` whose index errors say the range: `model.blocks[9]` / `mlp.experts[99]` raised torch's bare
`IndexError: index 9 is out of range`, while every other index of the library names its axis and range."""

from __future__ import annotations

from typing import Any, Iterable

from torch import nn

from mdm_lens import validate


class IndexedModules(nn.ModuleList):
    """A `ModuleList` of `what`s (e.g. "layer", "expert"): an int index is checked (negatives count from the end)."""

    def __init__(self, modules: Iterable[nn.Module] | None = None, what: str = "entry") -> None:
        super().__init__(modules)
        self.what = what

    def __getitem__(self, idx: Any) -> Any:
        if isinstance(idx, slice):
            return type(self)(list(self._modules.values())[idx], self.what)
        n = len(self)
        return super().__getitem__(validate.index(idx, n, name="index", what=f"{self.what} of these {n}"))
