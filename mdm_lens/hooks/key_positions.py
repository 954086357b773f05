"""Where a forward's key columns sit on the canvas, for the reducers: column c is position c on forwards whose
keys are the canvas prefix, `state.keys.start + c` on a window past position 0 (BD3LM's slid or short-context
windows), and `state.key_index[c]` where the keys are not one run of positions (a KV cache that skipped an
unstored block; `DenoisingState.key_positions`)."""

from __future__ import annotations

import torch
from torch import Tensor

from mdm_lens.diffusion.state import DenoisingState


def key_start(state: DenoisingState) -> int:
    """The canvas position of key column 0 of this step's forward: 0 unless the forward's keys are a window that
    starts past the canvas's first position (BD3LM's slid or short-context windows, `state.key_cols`)."""
    return state.keys.start if state.key_cols is not None else 0


def key_end(state: DenoisingState, n_keys: int) -> int:
    """One past the canvas position of the forward's last key column."""
    if state.key_index is not None:
        return int(state.key_index.max()) + 1
    return key_start(state) + n_keys


def moved_keys(state: DenoisingState, n_keys: int) -> Tensor | None:
    """The canvas position of each of the forward's `n_keys` key columns, or None when column c is position c
    (every forward whose keys are the canvas prefix)."""
    if state.key_index is not None:
        return state.key_index
    k0 = key_start(state)
    return torch.arange(k0, k0 + n_keys) if k0 else None


def place_keys(t: Tensor, state: DenoisingState, fill: float = 0.0) -> Tensor:
    """Put a last axis of key columns at their canvas positions (`fill` at the positions that are not keys of
    this forward, up to the last key; the reducers then right-pad to the final sequence as for any prefix)."""
    where = moved_keys(state, t.shape[-1])
    if where is None:
        return t
    out = t.new_full((*t.shape[:-1], int(where.max()) + 1), fill)
    out[..., where.to(t.device)] = t
    return out
