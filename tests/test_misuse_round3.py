"""Round 3 of misuse checks on mdm_lens.lens / sae / views: each case pins a class that used to crash with an
untyped error, read as another error, or returned a plausible value; now a typed error naming the argument."""

import numpy as np
import pandas as pd
import pytest
import torch

from mdm_lens import HookedMDM
from mdm_lens import lens as L
from mdm_lens import sae as S
from mdm_lens import views as V
from mdm_lens.errors import ArgumentError, ArgumentTypeError, InputError, NonFiniteError, OutOfRangeError
from mdm_lens.views import fig_cache as FC
from mdm_lens.views import stats


@pytest.fixture(scope="module")
def model():
    return HookedMDM.from_pretrained("mdm-lens/tiny-mdm")


IDS = torch.tensor([[1, 5, 6, 7, 9, 11]])


class Toy(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.W_enc = torch.nn.Parameter(torch.eye(d))
        self.W_dec = torch.nn.Parameter(torch.eye(d))

    def encode(self, x):
        return x @ self.W_enc

    def decode(self, a):
        return a @ self.W_dec


# --- empty inputs read as empty, not as a dtype error -------------------------------------------------------
@pytest.mark.parametrize("prompt", [torch.tensor([[]]), torch.tensor([])])
def test_an_empty_float_prompt_is_called_empty(model, prompt):
    with pytest.raises(ArgumentError, match="empty") as e:
        model.generate(prompt, gen_length=4, steps=2)
    assert e.value.argument == "prompt" and "non-empty int tensor" in str(e.value)
    with pytest.raises(ArgumentError, match="empty"):
        L.masked_kl(model, prompt)


def test_empty_metric_inputs_are_called_empty():
    with pytest.raises(ArgumentError, match="empty") as e:
        L.auc(y_true=torch.tensor([], dtype=torch.long), y_score=torch.tensor([]))
    assert e.value.argument == "y_score"


# --- lens ---------------------------------------------------------------------------------------------------
def test_lens_logits_refuses_nan_and_non_lens(model):
    with pytest.raises(NonFiniteError) as e:
        L.lens_logits(model, torch.full((1, 3, model.cfg.d_model), float("nan")), 0)
    assert e.value.argument == "resid"
    with pytest.raises(ArgumentTypeError, match="TunedLens"):
        L.lens_logits(model, torch.randn(1, 3, model.cfg.d_model), 0, lens="tuned")


def test_translate_checks_width_and_dtype(model):
    lens = L.TunedLens.identity(model)
    with pytest.raises(InputError, match="d_model=128"):
        lens.translate(torch.randn(2, model.cfg.d_model + 1), 0)
    with pytest.raises(ArgumentTypeError, match="float"):
        lens.translate(torch.ones(2, model.cfg.d_model, dtype=torch.long), 0)
    with pytest.raises(OutOfRangeError):
        lens.translate(torch.randn(2, model.cfg.d_model), 9)


def test_emergence_steps_checks_shapes():
    with pytest.raises(InputError, match="steps has 2"):
        L.emergence_steps(torch.ones(3, 1, 1, 2, dtype=torch.bool), [0, 1], torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(ArgumentError, match="horizon_end"):
        L.emergence_steps(torch.ones(2, 1, 1, 2, dtype=torch.bool), [0, 1], torch.zeros(5, dtype=torch.long))
    with pytest.raises(ArgumentTypeError, match="correct"):
        L.emergence_steps(torch.ones(2, 1, 1, 2), [0, 1], torch.zeros(1, 2, dtype=torch.long))
    first = L.emergence_steps(torch.tensor([False, True]).reshape(2, 1, 1, 1), [0, 1], torch.ones(1, 1, dtype=torch.long))
    assert first.item() == 1


# --- sae ----------------------------------------------------------------------------------------------------
def test_canvas_refuses_ids_outside_the_vocabulary(model):
    with pytest.raises(InputError, match=r"outside \[0, 322\)"):
        S.MaskedCanvas(model, mask_rate=0.5).mask(torch.full((1, 4), 10 ** 6))


def test_ce_score_argument_classes(model):
    sae, hook = Toy(model.cfg.d_model), "blocks.0.hook_resid_post"
    with pytest.raises(ArgumentTypeError, match="HookedMDM"):
        S.diffusion_ce_score("model", sae, hook, IDS)
    with pytest.raises(ArgumentError, match="mask_rates=\\[\\] is empty"):
        S.diffusion_ce_score(model, sae, hook, IDS, mask_rates=())
    with pytest.raises(ArgumentTypeError) as e:
        S.diffusion_ce_score(model, sae, hook, IDS, mask_rates="0.5")  # not split into '0', '.', '5'
    assert e.value.argument == "mask_rates"
    with pytest.raises(ArgumentError, match="seeds"):
        S.diffusion_ce_score(model, sae, hook, IDS, seeds=[])


# --- views --------------------------------------------------------------------------------------------------
def test_figure_inputs_raise_typed_errors_naming_the_argument():
    with pytest.raises(ArgumentTypeError) as e:
        V.temporal_heatmap(None)
    assert e.value.argument == "received"
    with pytest.raises(InputError, match="curves"):
        V.absorption_by_layer({})
    with pytest.raises(ArgumentTypeError, match="series"):
        V.accuracy_curves([1, 2], [0.1, 0.2])
    with pytest.raises(ArgumentTypeError, match="rows"):
        V.region_flow(np.ones((2, 3)), ["a", "b", "c"])
    with pytest.raises(InputError, match="received must be"):   # was a bare ValueError
        V.temporal_heatmap(np.ones(3))
    with pytest.raises(ArgumentTypeError) as e:
        V.attention_from_pattern(["a"], "pattern")
    assert e.value.argument == "pattern"


def test_report_and_markdown_arguments(tmp_path):
    with pytest.raises(ArgumentTypeError, match="text"):
        V.markdown_lite(3)
    with pytest.raises(ArgumentTypeError, match=r"sections\[0\]"):
        V.write_report(tmp_path / "r", "t", ["not a section"])
    with pytest.raises(ArgumentError, match="image_dpi"):
        V.write_report(tmp_path / "r", "t", [], image_dpi=-5)
    with pytest.raises(ArgumentError, match="renderer"):
        V.to_html("<b>x</b>", renderer="nope")


def test_stats_and_cache_views_refuse_what_they_cannot_read():
    with pytest.raises(ArgumentTypeError) as e:
        stats.difference(pd.Series([1.0, 2.0]), "x")
    assert e.value.argument == "b"
    table = pd.DataFrame({"item_id": ["i"], "kv_cache": ["prefix"], "step": pd.array([1], dtype="Int64"),
                          "block": pd.array([0], dtype="Int64"), "layer": pd.array([0], dtype="Int64"),
                          "metric": ["k_drift"], "value": [0.5]})
    assert FC.staleness_grid(table, "k_drift", "prefix").loc[0, 1] == 0.5
    with pytest.raises(ArgumentError, match="metric='k_drfit'"):
        FC.staleness_grid(table, "k_drfit", "prefix")               # a typo gave an empty grid
    with pytest.raises(ArgumentError, match="mode"):
        FC.staleness_grid(table, "k_drift", "full")
