"""Held-out misuse round 25, views: the step explorer's notes for a cumulative or renamed received-attention record
(S5), and the static figures' unchecked arguments -- choices, indices, shapes and output paths (S6, C3, C4)."""

import numpy as np
import pytest

from mdm_lens import views
from mdm_lens.errors import ArgumentError, ArgumentTypeError, InputError, OutOfRangeError
from mdm_lens.views import fig_lens

R = np.random.default_rng(0).random((5, 10))


# --- S5: the explorer ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    from mdm_lens import HookedMDM

    m = HookedMDM.from_pretrained("mdm-lens/tiny-mdm")
    return m, m.to_tokens("ctx: paris is the capital. q: capital? a:")


def test_explorer_notes_a_cumulative_record(tiny):
    from mdm_lens import ReceivedAttention

    m, p = tiny
    e = views.explore(m.generate(p, gen_length=8, steps=8, record=[ReceivedAttention(kind="cumulative")]), m)
    assert e.data[0]["received"]["kind"] == "cumulative"
    assert ("cumulative received attention (sum over queries, not a share: a key's value can exceed 1)"
            in e.data[0]["notes"])


def test_explorer_finds_a_renamed_record(tiny):
    from mdm_lens import ReceivedAttention

    m, p = tiny
    e = views.explore(m.generate(p, gen_length=8, steps=8, record=[ReceivedAttention(name="myra")]), m)
    assert e.data[0]["received"] is not None
    assert e.data[0]["notes"] == ["received attention from the record 'myra'"]


def test_explorer_without_record_says_what_it_looked_for(tiny):
    m, p = tiny
    e = views.explore(m.generate(p, gen_length=8, steps=8), m)
    assert e.data[0]["notes"] == [
        "no received-attention record (looked for 'received_attention' and any ReceivedAttention record under another "
        "name; records: none): generate with record=[ReceivedAttention()] to see it"]


# --- S6 / C4: temporal_heatmap ---------------------------------------------------------------------------
def test_temporal_heatmap_unknown_scale():
    with pytest.raises(ArgumentError, match=r"scale='loggg' is invalid: expected one of 'linear', 'sqrt', 'log'") as e:
        views.temporal_heatmap(R, scale="loggg")
    assert (e.value.argument, e.value.value) == ("scale", "loggg")


@pytest.mark.parametrize("value", [99, -1, 11])
def test_temporal_heatmap_prompt_length_out_of_range(value):
    with pytest.raises(OutOfRangeError, match=rf"prompt_length={value} is invalid: expected an int in \[0, 10\]") as e:
        views.temporal_heatmap(R, prompt_length=value)
    assert (e.value.argument, e.value.value) == ("prompt_length", value)


def test_temporal_heatmap_committed_step_past_the_rows():
    steps = [-1] * 5 + [0, 1, 2, 3, 99]
    with pytest.raises(OutOfRangeError, match=r"committed_step\[9\]=99 is invalid: expected a whole step in \[0, 4\]"):
        views.temporal_heatmap(R, committed_step=steps)


def test_temporal_heatmap_committed_step_edges_accepted():
    views.temporal_heatmap(R, committed_step=[-1] * 5 + [0, 1, 2, 4, np.nan], prompt_length=10)


def test_temporal_heatmap_unknown_cmap():
    with pytest.raises(ArgumentError, match=r"cmap='nope' is invalid: expected the name of a matplotlib colormap") as e:
        views.temporal_heatmap(R, cmap="nope")
    assert e.value.argument == "cmap"


def test_figure_path_with_another_suffix(tmp_path):
    target = tmp_path / "x.xyz"
    with pytest.raises(ArgumentError, match=r"x\.xyz' is invalid: expected a file name ending in \.png") as e:
        views.temporal_heatmap(R, path=target)
    assert e.value.argument == "path" and not target.exists()


def test_figure_path_is_a_folder(tmp_path):
    with pytest.raises(ArgumentError, match="is a folder: give a file path") as e:
        views.temporal_heatmap(R, path=tmp_path)
    assert (e.value.argument, e.value.value) == ("path", str(tmp_path))


def test_figure_path_under_a_file(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(ArgumentError, match="on its way is a file") as e:
        views.retrieval_heatmap(R, path=tmp_path / "f" / "sub" / "a.png")
    assert e.value.argument == "path"


def test_figure_path_creates_folders(tmp_path):
    views.retrieval_heatmap(R, path=tmp_path / "new" / "a.PNG")
    assert (tmp_path / "new" / "a.PNG").stat().st_size > 0


# --- S6 / C3: absorption_by_layer --------------------------------------------------------------------------
def test_absorption_nulls_of_an_unknown_model():
    with pytest.raises(ArgumentError, match=r"nulls has the model 'other', which is not in curves \(\['m'\]\)") as e:
        views.absorption_by_layer({"m": (np.ones(4), None)}, {"other": 2.0})
    assert (e.value.argument, e.value.value) == ("nulls", "other")


def test_absorption_null_of_the_wrong_length():
    with pytest.raises(InputError, match=r"nulls\['m'\] has shape \(3,\): expected a number or 4 values") as e:
        views.absorption_by_layer({"m": (np.ones(4), None)}, {"m": np.ones(3)})
    assert e.value.argument == "nulls['m']"


def test_absorption_two_d_mean():
    with pytest.raises(InputError, match=r"curves\['m'\] must be \(mean\[L\], std\[L\] or None\); mean has shape "
                                         r"\(2, 4\)") as e:
        views.absorption_by_layer({"m": (np.ones((2, 4)), None)})
    assert e.value.argument == "curves['m']"


def test_absorption_std_of_the_wrong_length():
    with pytest.raises(InputError, match=r"curves\['m'\] must be \(mean\[L\], std\[L\] or None\); std has 3 entries "
                                         r"\(shape \(3,\)\) for 4 layers") as e:
        views.absorption_by_layer({"m": (np.ones(4), np.ones(3))})
    assert e.value.argument == "curves['m']"


def test_absorption_curve_not_a_pair():
    with pytest.raises(InputError, match=r"curves\['m'\] must be \(mean\[L\], std\[L\] or None\); got array") as e:
        views.absorption_by_layer({"m": np.ones(4)})
    assert e.value.argument == "curves['m']"


def test_absorption_show_excess_without_nulls():
    with pytest.raises(ArgumentError, match="show_excess=True needs nulls") as e:
        views.absorption_by_layer({"m": (np.ones(4), None)}, show_excess=True)
    assert e.value.argument == "show_excess"


# --- the other figures -------------------------------------------------------------------------------------
def test_qk_maps_anchor_past_the_keys():
    m = np.ones((4, 4))
    with pytest.raises(OutOfRangeError, match=r"anchor_positions\[0\]=7 is invalid: expected a key position in "
                                               r"\[-4, 3\]") as e:
        views.qk_maps(m, m, m, anchor_positions=[7])
    assert e.value.argument == "anchor_positions[0]"


def test_qk_decomposition_two_d_terms():
    with pytest.raises(InputError, match=r"norm_term has shape \(2, 3\): expected one value per head") as e:
        views.qk_decomposition_bars(np.ones((2, 3)), np.ones((2, 3)))
    assert e.value.argument == "norm_term"


def test_region_flow_unknown_kind_and_gold():
    rows = {"first": [0.1, 0.2, 0.7]}
    with pytest.raises(ArgumentError, match=r"kind='bar' is invalid: expected one of 'heatmap', 'bars'") as e:
        views.region_flow(rows, ["a", "b", "c"], kind="bar")
    assert e.value.argument == "kind"
    with pytest.raises(OutOfRangeError, match=r"gold_index\['first'\]=5 is invalid") as e:
        views.region_flow(rows, ["a", "b", "c"], {"first": 5})
    assert e.value.argument == "gold_index['first']"
    with pytest.raises(ArgumentError, match=r"gold_index has the row 'last', which is not in rows \(\['first'\]\)"):
        views.region_flow(rows, ["a", "b", "c"], {"last": 0})


def test_retrieval_heatmap_threshold_and_outline():
    with pytest.raises(ArgumentTypeError, match="threshold='0.1' is invalid: expected a number"):
        views.retrieval_heatmap(R, threshold="0.1")
    with pytest.raises(ArgumentTypeError, match="outline='yes' is invalid: expected True or False"):
        views.retrieval_heatmap(R, outline="yes")


def test_knockout_error_bars_of_the_wrong_shape():
    with pytest.raises(InputError, match=r"anchor_err has shape \(3,\): expected \(2,\) \(± per point\) or \(2, 2\)"):
        views.knockout_effect(["L0", "L1"], [0.1, 0.2], [0.0, 0.1], anchor_err=[0.1, 0.1, 0.1])
    with pytest.raises(InputError, match=r"anchor_effect has shape \(2, 1\): expected 2 values"):
        views.knockout_effect(["L0", "L1"], [[0.1], [0.2]], [0.0, 0.1])


def test_accuracy_errors_for_an_unknown_series():
    with pytest.raises(ArgumentError, match=r"errors has the series 'ARM', which is not in series \(\['MDM'\]\)") as e:
        views.accuracy_curves([0, 1], {"MDM": [0.5, 0.6]}, errors={"ARM": [0.1, 0.1]})
    assert (e.value.argument, e.value.value) == ("errors", "ARM")
    with pytest.raises(InputError, match=r"errors\['MDM'\] has shape \(3,\)"):
        views.accuracy_curves([0, 1], {"MDM": [0.5, 0.6]}, errors={"MDM": [0.1, 0.1, 0.1]})


def test_lens_heatmap_empty_colour_range_and_emergence_shape():
    with pytest.raises(ArgumentError, match=r"vmax=0 is invalid: expected a number > vmin=0") as e:
        fig_lens.lens_heatmap(np.ones((2, 3)), [0, 1, 2], [0, 1], vmax=0.0)
    assert e.value.argument == "vmax"
    with pytest.raises(InputError, match=r"first must be \[2, 3\]") as e:
        fig_lens.emergence_map(np.ones(6), [1, 2, 3], [0, 1])
    assert e.value.argument == "first"
    with pytest.raises(OutOfRangeError, match=r"n_steps=2 is invalid: expected an int >= 4"):
        fig_lens.emergence_map(np.ones((2, 3)), [1, 2, 3], [0, 1], n_steps=2)
