"""Round 26 (helper): an ARM run refuses a received-attention query set it has no rows for, and the drift readers
say NaN (not 0) for an undefined series; a sweep prompt that is mostly the unknown token is flagged in the
manifest; figure functions name the argument (and the field to pass) for ragged or wrong-typed data."""

from __future__ import annotations

import pytest
import torch

from mdm_lens import HookedMDM, views
from mdm_lens.errors import ArgumentTypeError, SamplerConfigError
from mdm_lens.hooks.reducers import ReceivedAttention
from mdm_lens.probes import floating
from mdm_lens.probes import run as R
from mdm_lens import sweep
from mdm_lens.sweep import checks as K
from mdm_lens.sweep import templates as TM
from mdm_lens.zoo import jsonl


@pytest.fixture(scope="module")
def arm():
    return HookedMDM.from_pretrained("mdm-lens/tiny-arm")


@pytest.mark.parametrize("query", ["masked", "committed"])
def test_arm_refuses_a_query_set_it_has_no_rows_for(arm, query):
    ids = arm.to_tokens("the cat sat")
    with pytest.raises(SamplerConfigError, match=rf"ReceivedAttention\(query='{query}'\) on sampler='arm'") as e:
        arm.generate(ids, gen_length=4, progress=False, record=[ReceivedAttention(query=query)])
    assert e.value.argument == "query" and e.value.value == query


def test_drift_of_an_all_nan_series_is_nan_not_zero():
    received = torch.full((1, 3, 5), float("nan"))
    d = floating.drift(torch.zeros(1, 3, 5, dtype=torch.bool), received, nan_policy="omit")
    assert torch.isnan(d.persistence).all() and torch.isnan(d.stability).all()
    assert torch.isnan(d.empty_fraction).all() and d.modal_anchor.tolist() == [-1]


def test_anchor_readers_warn_on_an_all_nan_record(arm):
    out = arm.generate(arm.to_tokens("the cat sat"), gen_length=3, progress=False,
                       record=[ReceivedAttention(query="generated")])
    out.records["received_attention"][:] = float("nan")   # an undefined record (whatever its cause)
    with pytest.warns(R.UndefinedSeriesWarning, match=r"batch row\(s\) \[0\].*undefined, not empty"):
        d = R.drift_from_output(out, layer=0)
    assert torch.isnan(d.persistence).all()


def test_rag_prompt_mostly_unknown_tokens_is_warned(mdm, tmp_path):
    data = tmp_path / "items.jsonl"
    jsonl.export(data, 1, seed=0)
    item = sweep.read_items(data).items[0]
    unk = K.unknown_token_ids(mdm.tokenizer)
    r = TM.render(mdm, item, "rag")
    share = sum(i in unk for i in r.ids) / len(r.ids)
    assert share > K.UNKNOWN_SHARE_WARN
    (w,) = [w for w in K.render_warnings(r, unk) if "unknown token" in w]
    assert w.startswith(f"{sum(i in unk for i in r.ids)} of the prompt's {len(r.ids)} tokens ({share:.0%}) are "
                        "the tokenizer's unknown token (over 20%)")
    assert not [w for w in K.render_warnings(TM.render(mdm, item, "zoo"), unk) if "unknown token" in w]


def test_accuracy_curves_names_a_ragged_series():
    with pytest.raises(ArgumentTypeError, match=r"^series\['m'\]=tuple: expected an array of numbers") as e:
        views.accuracy_curves([0, 1, 2], {"m": ([0.1, 0.2], None)})
    assert e.value.argument == "series['m']"


def test_retrieval_heatmap_of_the_result_object_says_pass_scores():
    class RetrievalScores:  # the shape of the probe's result: a `.scores` [layer, head] tensor
        scores = torch.zeros(2, 3)

    with pytest.raises(ArgumentTypeError, match=r"^scores=RetrievalScores: .*pass result\.scores \(\(2, 3\)\), "
                                                r"not the RetrievalScores object") as e:
        views.retrieval_heatmap(RetrievalScores())
    assert e.value.argument == "scores"
