"""The diffusion CE score of an SAE: SAELens' "CE loss recovered" with the loss a masked diffusion LM is
trained on -- cross-entropy of the masked tokens of a masked canvas -- at fixed mask rates and seeds."""

from __future__ import annotations

import math
from typing import Any, Sequence

import pandas as pd
import torch
import torch.nn.functional as F
from torch import Tensor

from mdm_lens import validate
from mdm_lens.errors import ArgumentError, ArgumentTypeError, InputError
from mdm_lens.hook_surface import is_glob
from mdm_lens.sae.canvas import MaskedCanvas, maskable_positions, not_pad
from mdm_lens.sae.splice import _check_sae, _splice


def _masked_ce(logits: Tensor, tokens: Tensor, masked: Tensor) -> float:
    return F.cross_entropy(logits[masked].double(), tokens[masked], reduction="mean").item()


def _nonempty(values: Any, name: str, types: Any) -> list:
    """A non-empty list/tuple of numbers (a bare string would be split into characters by list())."""
    out = validate.instances(values, types, name=name)
    if not out:
        raise ArgumentError(f"{name}=[] is empty: the score needs at least one.", argument=name, value=values,
                            allowed="a non-empty list")
    return out


@torch.no_grad()
def diffusion_ce_score(model: Any, sae: Any, hook_name: str, tokens: Tensor, *,
                       mask_rates: Sequence[float] = (0.15, 0.5, 0.85), seeds: Sequence[int] = (0,),
                       use_error_term: bool = False) -> pd.DataFrame:
    """One row per (mask_rate, seed): masked-token CE of the clean model (`ce_clean`), with `sae` spliced at
    `hook_name` (`ce_sae`) and with that activation zero-ablated (`ce_zero`); `ce_recovered` =
    (ce_zero - ce_sae) / (ce_zero - ce_clean) (NaN with a `note` when the denominator is 0 or no token was
    masked); `fvu` (fraction of variance unexplained at the hook, over the canvas' non-pad positions) and `l0`
    (mean active latents per position). The same masks (the seed's) are used for all three runs.

    `tokens`: clean ids `[batch, pos]` (right-padded with the pad id, if at all); `<bos>` and pads are never masked.
    A mask id in `tokens` is refused (it would be a CE target the model never predicts). A canvas with every
    maskable token masked (rate 1, or by chance) is scored -- it is the t = 1 end of the training loss -- but its
    activations carry no token of the input, only positions (and <bos>), so its `note` says so: the score there
    measures the SAE off the distribution of the activations it will be used on.
    """
    from mdm_lens.lens.logit import check_model

    check_model(model)
    _check_sae(sae)
    tokens = validate.tensor(torch.as_tensor(tokens), name="tokens", ndim=(1, 2), dtype="int")
    if tokens.ndim == 1:
        tokens = tokens[None]
    if not isinstance(hook_name, str) or is_glob(hook_name):  # one activation is spliced
        raise ArgumentTypeError(f"hook_name={validate.describe(hook_name)} must name one hook point: the score "
                                "splices and zero-ablates one activation (globs and lists, which sae_hook and "
                                "run_with_hooks take, are not accepted here).", argument="hook_name",
                                value=hook_name, allowed="one hook name, e.g. 'blocks.1.hook_resid_post'")
    model.check_hook_name(hook_name) if hasattr(model, "check_hook_name") else None
    if hook_name not in model.hook_dict:
        raise InputError(f"hook_name={hook_name!r} is not a hook point of this model.", argument="hook_name",
                         value=hook_name, allowed="a name in model.hook_dict")
    rates = [validate.number(r, name=f"mask_rates[{j}]", min=0.0, max=1.0, min_open=True)
             for j, r in enumerate(_nonempty(mask_rates, "mask_rates", (int, float)))]
    seeds = [validate.seed(s, name=f"seeds[{j}]", min=None) for j, s in enumerate(_nonempty(seeds, "seeds", int))]
    for name, values in (("mask_rates", rates), ("seeds", seeds)):  # a repeat would count one setting twice
        if len(set(values)) != len(values):
            raise ArgumentError(f"{name}={values} repeats a value; list each once.", argument=name, value=values,
                                allowed=f"distinct {name}")
    use_error_term = validate.boolean(use_error_term, name="use_error_term")
    tokens = tokens.to(model.input_device)
    real = not_pad(model.cfg, tokens)
    attention_mask = real.long()
    rows = []
    for rate in rates:
        for seed in seeds:
            noisy, masked = MaskedCanvas(model, mask_rate=rate, positions="all", seed=seed).mask(tokens)
            seen: dict[str, Tensor] = {}

            def keep(x: Tensor, hook: Any) -> None:
                seen["x"] = x.detach()

            def splice(x: Tensor, hook: Any) -> Tensor:
                seen["x"] = x.detach()
                recon = _splice(sae, x, use_error_term, {}, ())
                seen["recon"] = recon.detach()
                # L0 from the SAE's own encoder, on the same input
                seen["l0"] = (sae.encode(x.to(sae.W_dec.dtype)) != 0).sum(-1).float()
                return recon

            def run(hook_fn: Any) -> Tensor:
                return model.run_with_hooks(noisy, attention_mask=attention_mask, return_type="aligned",
                                            fwd_hooks=[(hook_name, hook_fn)])

            clean = run(keep)
            spliced = run(splice)
            zero = run(lambda x, hook: torch.zeros_like(x))
            n = int(masked.sum())
            note = ""
            if n == 0:
                ce_c = ce_s = ce_z = math.nan
                note = "no token was masked at this rate and seed"
            else:
                ce_c, ce_s, ce_z = (_masked_ce(lg, tokens, masked) for lg in (clean, spliced, zero))
                if n == int(maskable_positions(model.cfg, tokens).sum()):
                    note = "every maskable token is masked: the canvas holds no input token (position-only " \
                           "activations)"
            den = ce_z - ce_c
            if n and den == 0:
                recovered = math.nan
                note = (note + "; " if note else "") + ("ce_zero == ce_clean: zero-ablating this hook does not change "
                                                        "the loss, so nothing to recover")
            else:
                recovered = (ce_z - ce_s) / den if n else math.nan
            x, recon = seen["x"][real].double(), seen["recon"][real].double()
            total = ((x - x.mean(0)) ** 2).sum().item()
            fvu = ((x - recon) ** 2).sum().item() / total if total > 0 else math.nan
            if total == 0:
                note = (note + "; " if note else "") + "the activation has zero variance: FVU undefined"
            rows.append({"mask_rate": rate, "seed": seed, "n_masked": n, "ce_clean": ce_c, "ce_sae": ce_s,
                         "ce_zero": ce_z, "ce_recovered": recovered, "fvu": fvu,
                         "l0": seen["l0"][real].mean().item(), "note": note})
    return pd.DataFrame(rows)
