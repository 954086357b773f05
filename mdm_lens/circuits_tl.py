"""TransformerLens circuit views of a `HookedMDM`: `OV`, `QK` (as TL `FactoredMatrix`) and TL's composition
scores.

Shapes are TL's: `[n_layers, n_heads, d_model, d_model]`, one factored matrix per query head; under GQA each
key/value head is repeated for its query heads (HF `repeat_kv` order), as TL does.

Where they mean what TL users expect:
- `QK` is `W_Q W_Kᵀ` *before* rotary. With RoPE the bilinear form between query position i and key position j is
  `W_Q R(j−i) W_Kᵀ`, so `QK` is the zero-offset (i = j) form only; the per-head q/k RMSNorms of the 2026
  families sit between the projections and rotary and are not in it either. Biases are left out, as in TL.
- `OV` (`W_V W_O`) is exact for what a head writes per unit of attention; value biases are not in it (see
  `fold_value_biases`).
- Both read the model's matrices as they are: on an unprocessed model a head's input is `ln1.w ⊙ x/scale`, so
  compare heads of different layers (composition scores) after `process_weights_(fold_ln=True)`, when the norm
  weights are inside `W_Q/W_K/W_V` and the read-side matrices see the normalised residual directly.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from jaxtyping import Float
from torch import Tensor
from transformer_lens import FactoredMatrix
from transformer_lens.utilities import composition_scores

from mdm_lens import validate


class CircuitMatrix(FactoredMatrix):
    """TL's `FactoredMatrix`, whose out-of-range index error names its own shape: the factor views check the index
    first, and their error named a factor's shape (`model.OV[9]`: W_V's `[4, 4, 128, 32]`)."""

    def __getitem__(self, idx: Any) -> Any:
        from mdm_lens.errors import ArgumentError

        self._check_ints(idx)
        try:
            out = super().__getitem__(idx)
        except ArgumentError as e:  # a factor view's OutOfRangeError / InputTypeError
            shape = tuple(self.shape)
            what = "out of range" if isinstance(e, IndexError) else "not a tensor index"
            raise type(e)(f"index {idx!r} is {what} for a weight view of shape {shape} (a FactoredMatrix; axes in "
                          "TransformerLens order, e.g. [layer, head, d_model, d_model]; negative values count from "
                          "the end).", argument="index", value=idx, allowed=f"indices within {shape}") from None
        return CircuitMatrix(out.A, out.B) if type(out) is FactoredMatrix else out

    def _check_ints(self, idx: Any) -> None:
        """Every int index against its axis: TL turns an int on the two matrix axes into a one-wide slice, so one
        past the end (`OV[0, 0, :, 999]`) gave an empty matrix instead of an error."""
        items = idx if isinstance(idx, tuple) else (idx,)
        if any(i is None for i in items):
            return  # a new axis shifts the positions: left to the factors' own checks
        shape = tuple(self.shape)
        cut = next((k for k, i in enumerate(items) if i is Ellipsis), len(items))
        tail = items[cut + 1:]
        placed = list(enumerate(items[:cut])) + [(len(shape) - len(tail) + j, i) for j, i in enumerate(tail)]
        for axis, i in placed:
            n = shape[axis] if 0 <= axis < len(shape) else None
            if isinstance(i, int) and not isinstance(i, bool) and n is not None and not -n <= i < n:
                from mdm_lens.errors import OutOfRangeError

                raise OutOfRangeError(f"index {idx!r} is out of range for a weight view of shape {shape}: axis {axis} "
                                      f"takes [-{n}, {n - 1}] (negative values count from the end).",
                                      argument=f"index[{axis}]", value=i, allowed=f"[-{n}, {n - 1}]")


def qk_circuit(model: Any) -> FactoredMatrix:
    """`W_Q @ W_Kᵀ` per layer and query head, `[n_layers, n_heads, d_model, d_model]` (before rotary)."""
    return CircuitMatrix(model.W_Q, model.W_K.transpose(-2, -1))


def ov_circuit(model: Any) -> FactoredMatrix:
    """`W_V @ W_O` per layer and head, `[n_layers, n_heads, d_model, d_model]`."""
    return CircuitMatrix(model.W_V, model.W_O)


def all_composition_scores(model: Any, mode: Literal["Q", "K", "V"]
                           ) -> Float[Tensor, "left_layer left_head right_layer right_head"]:
    """TL's composition scores `‖L R‖_F / (‖L‖_F ‖R‖_F)` from each head's OV circuit (left) into a later head's
    QK (mode "Q": query side, "K": key side, QKᵀ) or OV ("V") circuit (right), for every pair of heads.

    A head can only compose into a head of a later layer; pairs with left layer ≥ right layer are NaN (TL writes
    0, which reads as "measured: no composition"). See the module docstring for rotary and norm folding."""
    mode = validate.choice(mode, ("Q", "K", "V"), name="mode")
    left = ov_circuit(model)
    if mode == "V":
        right = left
    else:
        right = qk_circuit(model)
        right = right if mode == "Q" else right.T
    scores = composition_scores(left, right, broadcast_dims=True)
    n = model.cfg.n_layers
    layer = torch.arange(n, device=scores.device)
    later = layer[:, None, None, None] < layer[None, None, :, None]
    return torch.where(later, scores, torch.full_like(scores, float("nan")))
