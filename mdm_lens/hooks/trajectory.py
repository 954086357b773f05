"""`TrajectoryCache`: full activations for chosen hook names at chosen denoising steps.

    cache = TrajectoryCache("blocks.0.attn.hook_pattern", steps(0, -1))
    out = model.generate(prompt, ..., cache=cache)          # or cache="blocks.0.attn.hook_pattern" @ steps(0, -1)
    out.cache[0]                  # TransformerLens ActivationCache of step 0
    out.cache.stack("blocks.0.attn.hook_pattern")     # [step, batch, head, query, key]

The bytes it will need are estimated before the run and the run is refused (MemoryBudgetError) if
they exceed `budget_bytes`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformer_lens import ActivationCache

from mdm_lens.diffusion.state import DenoisingState
from mdm_lens.errors import InputError
from mdm_lens.hooks.memory import DEFAULT_BUDGET, check_budget, human
from mdm_lens.hooks.names import expand_names
from mdm_lens.hooks.steps import ALL_STEPS, CacheRequest, Steps


class TrajectoryCache:
    def __init__(self, names: Any, steps: Steps = ALL_STEPS, budget_bytes: int = DEFAULT_BUDGET,
                 device: str | torch.device | None = "cpu"):
        self.names_arg, self.when, self.budget_bytes, self.device = names, steps, budget_bytes, device
        self.names: list[str] = []
        self._steps: dict[int, dict[str, Tensor]] = {}
        self.estimated_bytes = 0
        self.model: Any = None

    @classmethod
    def from_request(cls, request: Any) -> "TrajectoryCache":
        if isinstance(request, TrajectoryCache):
            return request
        if isinstance(request, CacheRequest):
            return cls(request.names, request.steps)
        return cls(request)  # names only: every step

    def begin(self, model: Any, batch: int, max_pos: int, n_steps: int) -> None:
        self.model = model
        self.names = expand_names(model, self.names_arg)
        n_cached = self.when.max_count(n_steps)  # blocks are only known during the run: an upper bound
        dtype_bytes = torch.finfo(model.cfg.dtype).bits // 8
        self.estimated_bytes = check_budget(model.cfg, self.names, n_cached, batch, max_pos, dtype_bytes,
                                            self.budget_bytes)
        self._steps = {}

    def active(self, state: DenoisingState) -> bool:
        return self.when.matches(state.step, state.n_steps, state.block, state.phase)

    def hooks(self, model: Any, state: DenoisingState) -> list[tuple[str, Any]]:
        store = self._steps.setdefault(state.step, {})

        def save(tensor: Tensor, hook: Any) -> None:
            store[hook.name] = tensor.detach().to(self.device)

        return [(name, save) for name in self.names]

    # --- access -------------------------------------------------------------------------------------
    @property
    def steps(self) -> list[int]:
        return sorted(self._steps)

    def __len__(self) -> int:
        return len(self._steps)

    def __getitem__(self, step: int) -> ActivationCache:
        steps = self.steps
        if step < 0:
            step = steps[step] if -len(steps) <= step else step
        if step not in self._steps:
            raise InputError(f"step {step} was not cached; cached steps: {steps}.")
        return ActivationCache(self._steps[step], self.model)

    def stack(self, name: str, pad_value: float | None = None) -> Tensor:
        """`[step, ...]` over the cached steps. ARM prefixes grow, so give `pad_value` to right-pad."""
        if name not in self.names:
            raise InputError(f"{name!r} was not cached; cached names: {self.names}.")
        tensors = [self._steps[s][name] for s in self.steps]
        shapes = {tuple(t.shape) for t in tensors}
        if len(shapes) > 1:
            if pad_value is None:
                raise InputError(f"{name} has different shapes across steps ({sorted(shapes)}: the ARM prefix grows); "
                                 "pass pad_value=0.0 to right-pad.")
            target = [max(s[i] for s in shapes) for i in range(len(tensors[0].shape))]
            tensors = [torch.nn.functional.pad(t, [p for d in reversed(range(t.ndim))
                                                    for p in (0, target[d] - t.shape[d])], value=pad_value)
                       for t in tensors]
        return torch.stack(tensors)

    def __repr__(self) -> str:
        return (f"TrajectoryCache({len(self.names)} name(s), steps={self.steps}, "
                f"estimated {human(self.estimated_bytes)})")
