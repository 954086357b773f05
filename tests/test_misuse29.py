"""Held-out misuse run 29 (issue #32 §3): each test fails on the code before its fix."""

from __future__ import annotations

import json
import math

import matplotlib
import pytest
import torch

matplotlib.use("Agg")

from mdm_lens import HookedMDM, views  # noqa: E402
from mdm_lens.errors import ArgumentTypeError, InputError  # noqa: E402
from mdm_lens.probes import floating as F  # noqa: E402


def _frame(received):
    return F.drift(F.detect_anchors(received), received).to_frame()


def _row(frame, metric):
    (row,) = frame[frame.metric == metric].itertuples()
    return row


def test_stability_without_any_anchor_is_nan_with_a_reason_and_modal_anchor_is_no_position():
    """S1: stability was 0.0 (and modal_anchor -1 in the frame) when no step had an anchor."""
    d = F.drift(F.detect_anchors(torch.full((4, 10), 0.1, dtype=torch.float64)),
                torch.full((4, 10), 0.1, dtype=torch.float64))
    assert math.isnan(d.stability.item()) and d.modal_anchor.item() == -1 and d.empty_fraction.item() == 1.0
    f = d.to_frame()
    for metric in ("stability", "modal_anchor"):
        row = _row(f, metric)
        assert math.isnan(row.value) and row.reason == "no anchor at any step"
    # an anchored series keeps its numbers and an empty reason
    received = torch.tensor([[0.05] * 9 + [0.55]] * 3, dtype=torch.float64)
    g = _frame(received)
    assert _row(g, "stability").value == 1.0 and _row(g, "modal_anchor").value == 9.0
    assert _row(g, "stability").reason == "" and _row(g, "modal_anchor").reason == ""
    # the layer label is unchanged: a series with no anchor is diffuse
    flat = torch.full((4, 10), 0.1, dtype=torch.float64)
    assert F.classify_layer(d, F.initial_absorption(flat)).labels.item() == "diffuse"


def test_every_nan_of_a_drift_frame_carries_its_reason():
    """U1: NaN drift metrics had no reason anywhere (no column, no label, no warning)."""
    received = torch.tensor([[0.05] * 9 + [0.55]] * 3, dtype=torch.float64)        # one constant anchor
    f = _frame(received)
    assert _row(f, "centroid_spearman").reason == "constant centroid: no rank order"
    one = _frame(received[:1])                                                      # a 1-step run
    want = {"mean_jaccard": "one step: no step pair", "drift_index": "one step: no step pair",
            "top1_change_rate": "one step: no step pair", "mean_w1": "one step: no step pair",
            "centroid_slope": "fewer than two steps with anchors",
            "centroid_spearman": "fewer than two steps with anchors"}
    assert {r.metric: r.reason for r in one[one.value.isna()].itertuples()} == want
    for frame in (f, one, _frame(torch.full((3, 6), 0.2, dtype=torch.float64))):
        assert (frame.value.isna() == (frame.reason != "")).all()


@pytest.mark.parametrize("err", [[-1.0, 1.0], [[0.1, 0.2], [-0.1, 0.1]]])
def test_knockout_effect_refuses_negative_error_bars(err):
    """C1: matplotlib's raw ValueError ('yerr' must not contain negative values)."""
    with pytest.raises(InputError, match="negative values .* distances") as info:
        views.knockout_effect([0, 1], [0.1, 0.2], [0.0, 0.1], anchor_err=err)
    assert info.value.argument == "anchor_err"


def test_accuracy_band_refuses_reversed_bounds():
    with pytest.raises(InputError, match="lower bound lies above its upper bound"):
        views.accuracy_curves([0, 1], {"m": [0.5, 0.6]}, errors={"m": [[0.6, 0.5], [0.4, 0.7]]})


@pytest.mark.parametrize("prompt", [7, ["a", "b"], "", {"text": "x"}])
def test_a_sweep_line_whose_prompt_is_not_a_string_says_so(tmp_path, prompt):
    """U2: reported as 'no question ... and no prompt' though the line has a prompt."""
    from mdm_lens.sweep.items import read_items

    data = tmp_path / "items.jsonl"
    data.write_text(json.dumps({"id": "a", "prompt": prompt}) + "\n")
    with pytest.raises(InputError, match=r"items\.jsonl:1: the prompt must be a non-empty string, got "):
        read_items(data)
    data.write_text(json.dumps({"id": "a"}) + "\n")
    with pytest.raises(InputError, match="no question .* and no prompt"):
        read_items(data)


@pytest.fixture(scope="module")
def tiny():
    return HookedMDM.from_pretrained("mdm-lens/tiny-mdm")


def test_a_misspelt_probe_keyword_names_the_probe_and_its_nearest_argument(tiny):
    """U3: blamed on the sampler's settings ('unknown setting layer=... for sampler llada')."""
    from mdm_lens.probes import patching as PT
    from mdm_lens.probes import retrieval as RT
    from mdm_lens.zoo import data as D
    from mdm_lens.zoo import tokenizer as ZT

    items = D.make_dataset(2, seed=1, n_distractors=1)
    prompt = torch.tensor(ZT.encode(items[0].prompt))[None]
    for call, probe, key, near in (
            (lambda: RT.ablation_accuracy(tiny, items, [(0, 2)], k=1, mode="uniform"), "ablation_accuracy", "mode",
             "method"),
            (lambda: RT.retrieval_scores(tiny, items, methd="copy@any"), "retrieval_scores", "methd", "method"),
            (lambda: PT.knockout(tiny, prompt, answer="purple", layer=[0]), "knockout", "layer", "layers"),
            (lambda: RT.answer_accuracy(tiny, items, gen_lenght=4), "answer_accuracy", "gen_lenght", "gen_length")):
        with pytest.raises(ArgumentTypeError, match=rf"{probe}\(\) got an unknown keyword {key}=.*did you mean {near}=\?"):
            call()
    # sampler settings still pass through (another sampler's setting keeps the sampler's own refusal)
    from mdm_lens.errors import SamplerConfigError

    with pytest.raises(SamplerConfigError, match="setting of sampler 'dream'"):
        PT.knockout(tiny, prompt, answer="purple", alg="entropy")


def test_figures_of_all_nan_curves_raise_no_numpy_warning():
    """Note: an all-NaN curve leaked numpy's 'All-NaN slice encountered' RuntimeWarning (and emergence_map's colour
    scale crashed on int(NaN))."""
    import warnings

    import matplotlib.pyplot as plt

    from mdm_lens.views.fig_attention import absorption_by_layer
    from mdm_lens.views.fig_lens import emergence_map

    nan = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        figs = [absorption_by_layer({"m": ([nan, nan], [nan, nan])}), views.accuracy_curves([0, 1], {"m": [nan, nan]}),
                views.retrieval_heatmap([[nan, nan], [0.2, nan]]), emergence_map([[nan, nan]], [nan, nan], [0])]
    for fig in figs:
        plt.close(fig)


def test_a_report_section_whose_table_has_no_rows_says_so(tmp_path, mdm):
    """Note: an absorption table with no rows dropped its section without a word."""
    import pandas as pd

    from mdm_lens import sweep
    from mdm_lens.views.sweep_report import load_sweeps, sections
    from mdm_lens.zoo import jsonl

    data = tmp_path / "items.jsonl"
    jsonl.export(data, 1, seed=0)
    sweep.run(mdm, data, "accuracy", tmp_path / "s" / "a", progress=False)
    cols = ["item_id", "layer", "mode", "variant", "metric", "value"]
    pd.DataFrame({c: pd.Series([], dtype="float64" if c == "value" else "object") for c in cols}).to_parquet(
        tmp_path / "s" / "a" / "absorption.parquet")
    secs = {s.title: s for s in sections(load_sweeps(tmp_path / "s"), tmp_path / "img")}
    (title,) = [t for t in secs if "bsorption" in t]
    assert any("absorption table has no rows" in w for w in secs[title].absent)


def test_attribution_patching_names_a_misspelt_keyword_on_a_prompt_and_refuses_any_on_a_finished_run(tiny):
    from mdm_lens.errors import ArgumentError
    from mdm_lens.probes import attribution as AT

    prompt = tiny.to_tokens("The capital is")
    with pytest.raises(ArgumentTypeError, match=r"attribution_patching\(\) got an unknown keyword stepz=.*did you mean steps=\?"):
        AT.attribution_patching(tiny, prompt, "knockout", gen_length=3, stepz=[0])
    out = tiny.generate(prompt, gen_length=3, steps=3)
    with pytest.raises(ArgumentError, match="ignored when out_or_clean is a finished run"):
        AT.attribution_patching(tiny, out, "knockout", steps=[0], stepz=[0])
