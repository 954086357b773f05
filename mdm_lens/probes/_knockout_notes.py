"""Notes on knockout's long-format rows (`KnockoutResult.to_frame`, the sweep's knockout.parquet): why a value is NaN (a metric the sampler cannot give, a step the run never
reached, a step at which the quantity is undefined), never an empty note."""

from __future__ import annotations

import pandas as pd


def metric_notes(df: pd.DataFrame, notes: list[str]) -> None:
    """NaN rows of a metric the run's sampler cannot give (teacher-forced on DiffusionGemma / nemotron / bd3lm) or of
    a grid step the run never reached carry the result's note saying so, not an empty one."""
    tf = tuple(c for c in df["metric"].unique() if c.startswith("tf_")) + ("step_metric", "metric_mean")
    for prefix, metrics in (("teacher-forced metrics", tf), ("steps [", ("n_targets",))):
        why = next((n for n in notes if n.startswith(prefix)), None)
        if why is not None:
            at = df["metric"].isin(metrics) & df["value"].isna()
            df.loc[at, "note"] = why
    no_answer = (df["metric"] == "accuracy") & df["value"].isna() & (df["note"] == "")
    df.loc[no_answer, "note"] = "no answer was given: accuracy is a substring match with `answer`"
    if "step" not in df:  # only per-condition metrics were asked for
        return
    # per-step values NaN by definition at that step (the grid's other steps have values)
    per_step = df["value"].isna() & (df["note"] == "") & df["step"].notna()
    df.loc[per_step & df["metric"].str.startswith("tf_"), "note"] = (
        "no gold answer position is still masked at this step (all committed earlier): nothing to teacher-force")
    df.loc[per_step & (df["metric"] == "step_metric"), "note"] = (
        "this step committed no position (e.g. a prefill or KV-storing forward): the committed-position metric is "
        "undefined")
