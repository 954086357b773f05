"""Answer emergence ("known before decoded"): for each answer position and layer, the first step from which the
lens' top-1 is the final token and stays so.

    trace = lens_trace(model, out)                    # logit or tuned lens
    answer_emergence(trace)                           # one row per (batch, layer, position)

`horizon="commit"` (default) asks the top-1 to stay the final token up to and including the step that committed
the position (in that step's input the position is still masked, so this is what the model knew *before*
decoding it); `horizon="end"` asks it to stay so up to the last recorded step (after the commit the position
shows its token, so later steps test whether the layer keeps it). The final token is the one the run returned
(see `mdm_lens.lens.logit`). Emergence is measured on the recorded steps: a trace of every 4th step gives the
first recorded step of the final stable run. `lead = commit_step - emergence_step` (steps known before decoded).
A position where the top-1 is not the final token at the horizon has no emergence: NA with the reason in `note`.
On a trace read from a windowed run (Nemotron, BD3LM: `mdm_lens.lens.run_only`) a (step, position) the run's
forwards did not compute has top-1 −1: it is skipped (neither counted nor breaking the run); a position with no
computed step up to its horizon is NA, noted as such (not as a wrong top-1).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from mdm_lens import validate
from mdm_lens.errors import ArgumentTypeError, InputError

__all__ = ["answer_emergence", "emergence_steps", "HORIZONS"]

HORIZONS = ("commit", "end")


def emergence_steps(correct: Tensor, steps: list[int], horizon_end: Tensor, computed: Tensor | None = None) -> Tensor:
    """Vectorised core: `correct` `[step, layer, batch, pos]` (bool, over the recorded `steps`), `horizon_end`
    `[batch, pos]` (last step that counts), `computed` (same shape as `correct`, default all True: False where the
    lens has no value, e.g. a row a windowed forward did not compute; such cells neither count nor break the run).
    Returns `[layer, batch, pos]` long: the first recorded step s <= end with correct at every computed recorded
    step in [s, end]; -1 where there is none (a tensor has no NA: `answer_emergence` turns it into <NA> with a
    note)."""
    correct = validate.tensor(correct, name="correct", ndim=4, dtype="bool")
    st = torch.as_tensor(validate.instances(list(steps) if isinstance(steps, (list, tuple, range)) else steps, int,
                                            name="steps"))
    if len(st) != correct.shape[0]:
        raise InputError(f"steps has {len(st)} entries for correct's {correct.shape[0]} recorded steps.",
                         argument="steps", value=list(steps), allowed=f"{correct.shape[0]} step indices")
    validate.tensor(horizon_end, name="horizon_end", shape=tuple(correct.shape[2:]), dtype="int")
    if computed is not None:
        validate.tensor(computed, name="computed", shape=tuple(correct.shape), dtype="bool")
    inside = (st[:, None, None] <= horizon_end[None])[:, None]          # [step, 1, batch, pos]
    inside = inside & computed if computed is not None else inside.expand_as(correct)
    run = torch.ones(correct.shape[1:], dtype=torch.bool)              # all correct from here to the end (so far)
    first = torch.full(correct.shape[1:], -1, dtype=torch.long)
    for i in range(len(steps) - 1, -1, -1):                             # walk back from the horizon
        here = inside[i]
        run = torch.where(here, run & correct[i], run)
        first = torch.where(here & run, st[i], first)
    return first


def answer_emergence(trace, *, horizon: str = "commit") -> pd.DataFrame:
    """One row per (batch, layer, position) of a `LensTrace`: `final_token`, `commit_step`, `emergence_step`,
    `lead` (Int64; NA where undefined) and `note` (why NA)."""
    from mdm_lens.lens.logit import LensTrace

    if not isinstance(trace, LensTrace):
        raise ArgumentTypeError(f"trace={validate.describe(trace)} is not a LensTrace (from lens_trace).",
                                argument="trace", value=trace, allowed="a LensTrace")
    horizon = validate.choice(horizon, HORIZONS, name="horizon")
    S, L, B, P = trace.top1.shape
    commit = trace.commit_step
    last = max(trace.steps)
    end = commit.clone() if horizon == "commit" else torch.full_like(commit, last)
    end = torch.where(end < 0, torch.full_like(end, last), end)        # never committed (idle): up to the last step
    computed = trace.top1 >= 0  # a run-only trace marks rows its forwards did not compute with -1
    first = emergence_steps(trace.correct, trace.steps, end, computed)
    st = torch.as_tensor(trace.steps)[:, None, None, None]
    # the last recorded step with a lens value at or before the horizon, per (layer, row, position)
    recorded_end = torch.where((st <= end[None, None]) & computed, st, -1).amax(0)
    li, bi, pi = np.indices((L, B, P)).reshape(3, -1)
    f = first.numpy()[li, bi, pi]
    c = commit.numpy()[bi, pi]
    e = recorded_end.numpy()[li, bi, pi]
    note = np.full(f.shape, None, dtype=object)
    note[(f < 0) & (e >= 0)] = [f"top-1 is not the final token at step {s}" for s in e[(f < 0) & (e >= 0)]]
    uncomputed = bool((~computed).any())
    note[e < 0] = ("no recorded step with a lens value at or before the "
                   f"{'commit' if horizon == 'commit' else 'last step'}" +
                   (" (the run's forwards did not compute this position there: trace.meta['not_computed'])"
                    if uncomputed else ""))
    df = pd.DataFrame({"batch": bi, "layer": np.asarray(trace.layers)[li], "position": np.asarray(trace.positions)[pi],
                       "final_token": trace.final_tokens.numpy()[bi, pi], "commit_step": c,
                       "emergence_step": f, "note": pd.array(note, dtype="string")})
    for col in ("batch", "layer", "position", "final_token", "commit_step", "emergence_step"):
        df[col] = df[col].astype("Int64")
    df.loc[f < 0, "emergence_step"] = pd.NA
    df.loc[c < 0, "commit_step"] = pd.NA
    df.insert(6, "lead", (df["commit_step"] - df["emergence_step"]).astype("Int64"))
    df["horizon"] = horizon
    return df
