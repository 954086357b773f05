"""The step explorer's data and arguments (no browser needed; tests/test_explorer_browser.py renders it)."""

from __future__ import annotations

import json

import pytest
import torch

from mdm_lens import HookedMDM, MDMConfig, ReceivedAttention
from mdm_lens.errors import MDMLensError
from mdm_lens.views import explore, step_mapping


@pytest.fixture(scope="module")
def pair():
    runs = []
    for attention, seed in (("bidirectional", 3), ("causal", 4)):
        cfg = MDMConfig(d_model=32, n_layers=2, n_heads=4, d_mlp=48, d_vocab=40, n_ctx=64, attention=attention,
                        mask_token_id=39, eos_token_id=38)
        m = HookedMDM.from_config(cfg, seed=seed, init_std=0.4, init="realistic")
        runs.append(m.generate(torch.tensor([[1, 5, 9, 12]]), steps=6, gen_length=6, record=[ReceivedAttention()]))
    return runs


def _data(view):
    return json.loads(view.json.replace("<\\/", "</"))["runs"]


def test_values_are_the_records_head_mean_last(pair):
    out, _ = pair
    d = _data(explore(out))[0]
    rec = out.records["received_attention"][:, 0]                       # [step, layer, head, key]
    assert d["received"]["heads"] == ["0", "1", "2", "3", "mean"]
    for si, s in enumerate(d["steps"]):
        got = torch.tensor(d["received"]["values"][si][1], dtype=torch.float64)   # layer 1: [head+mean, key]
        want = torch.cat([rec[s, 1], rec[s, 1].mean(0, keepdim=True)]).double()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
    assert d["commit_step"] == out.trajectory.commit_step[0].tolist()


def test_arm_keys_that_do_not_exist_yet_are_null(pair):
    _, arm = pair
    d = _data(explore(arm))[0]
    cs = arm.trajectory.commit_step[0]
    for si, s in enumerate(d["steps"]):
        row = d["received"]["values"][si][0][-1]
        for pos, v in enumerate(row):
            assert (v is None) == bool(cs[pos] >= s), (s, pos)


def test_thinning_and_head_limit_are_stated(pair):
    out, _ = pair
    view = explore(out, max_steps=3, max_heads=2)
    d = _data(view)[0]
    assert d["steps"] == [0, 2, 5]          # evenly spaced, first and last kept
    assert d["received"]["heads"] == ["mean"]
    assert any("max_steps=3" in n for n in d["notes"]) and any("max_heads=2" in n for n in d["notes"])


def test_step_mapping():
    assert step_mapping(8, 8, 5) == 5
    assert step_mapping(8, 5, 7) == 4 and step_mapping(8, 5, 0) == 0
    assert step_mapping(1, 4, 0) == 0
    with pytest.raises(MDMLensError, match="step"):
        step_mapping(8, 5, 8)


def test_differing_step_counts_are_said(pair):
    out, arm = pair
    assert out.n_steps == arm.n_steps == 6
    assert not any("step counts differ" in n for n in explore([out, arm], labels=["a", "b"]).notes)
    short = arm.__class__(**{**arm.__dict__})
    short.trajectory = arm.trajectory.__class__(**{**arm.trajectory.__dict__, "x_steps": arm.trajectory.x_steps[:4],
                                                   "block_of_step": arm.trajectory.block_of_step[:4]})
    view = explore([out, short], labels=["a", "b"])
    assert any("step counts differ (a: 6, b: 4)" in n for n in view.notes)
    assert "</script" not in view.json


@pytest.mark.parametrize("kwargs, match", [
    (dict(item=1), "item"), (dict(max_steps=1), "max_steps"), (dict(max_heads=0), "max_heads"),
    (dict(lens_top1=torch.zeros(2, 2, 3, dtype=torch.long)), "lens_top1"),
    (dict(lens_top1=torch.zeros(6, 2, 10)), "lens_top1"),
])
def test_bad_arguments_raise_typed_errors(pair, kwargs, match):
    with pytest.raises(MDMLensError, match=match):
        explore(pair[0], **kwargs)


def test_runs_and_models_are_checked(pair):
    with pytest.raises(MDMLensError, match="runs"):
        explore([])
    with pytest.raises(MDMLensError, match="runs"):
        explore("not a run")
    with pytest.raises(MDMLensError, match="models"):
        explore(list(pair), models=[None])
    with pytest.raises(MDMLensError, match="labels"):
        explore(list(pair), labels=["one"])


def test_lens_overlay_names_tokens(pair):
    out, _ = pair
    top = torch.full((out.n_steps, 2, out.tokens.shape[1]), 7, dtype=torch.long)
    top[:, :, 0] = -1
    d = _data(explore(out, lens_top1=top))[0]
    assert d["lens"][0][1][0] is None and d["lens"][0][1][1] == "#7"


def test_block_spans_come_from_the_run(pair):
    out, arm = pair
    assert _data(explore(out))[0]["block_span"] == [None] * 6          # one block: nothing to mark
    assert _data(explore(arm))[0]["block_span"] == [None] * 6
    cfg = MDMConfig(d_model=32, n_layers=1, n_heads=2, d_mlp=32, d_vocab=40, mask_token_id=39, eos_token_id=38)
    m = HookedMDM.from_config(cfg, seed=5, init_std=0.4)
    semi = m.generate(torch.tensor([[1, 5, 9]]), steps=6, gen_length=6, block_length=2, record=[ReceivedAttention()])
    d = _data(explore(semi))[0]
    assert d["block_span"] == [[3 + 2 * (s // 2), 5 + 2 * (s // 2)] for s in range(6)]
    # a block sampler's own block_slice wins (blocks aligned at 0, not after the prompt)
    semi.trajectory.forwards = [dict(block_slice=slice(4 * (s // 3), 4 * (s // 3) + 4)) for s in range(6)]
    assert _data(explore(semi))[0]["block_span"] == [[0, 4]] * 3 + [[4, 8]] * 3


def test_kv_age_is_read_at_the_records_steps(pair):
    out, _ = pair
    run = out.__class__(**{**out.__dict__, "records": {**out.records, "kv_age": torch.arange(2)[:, None].expand(2, 10)},
                           "record_meta": {**out.record_meta, "kv_age": {"steps": [1, 4]}}})
    ages = _data(explore(run))[0]["kv_age"]
    assert ages[1] == [0] * 10 and ages[4] == [1] * 10 and ages[0] is None and ages[5] is None


@pytest.mark.parametrize("family", ["llada2", "sdar"])
def test_block_runs_with_records_keep_the_runs_positions(tmp_path, family):
    from loss_family_models import family_model

    model = family_model(family, tmp_path)
    out = model.generate(torch.tensor([[1, 5, 9, 12, 7]]), gen_length=8, block_length=4,
                         record=[ReceivedAttention()])
    d = _data(explore(out))[0]
    width = out.tokens.shape[1]
    assert len(d["tokens"]) == width
    for per_step in d["received"]["values"]:
        if per_step is not None:
            assert all(len(head) <= width for layer in per_step for head in layer)
    assert all(span is None or span[1] - span[0] == 4 for span in d["block_span"])


def test_a_run_is_shown_only_with_its_own_model(pair):
    out, _ = pair
    other = HookedMDM.from_config(MDMConfig(d_model=16, n_layers=1, n_heads=2, d_mlp=16, d_vocab=20,
                                            mask_token_id=19), seed=0)
    with pytest.raises(MDMLensError, match="models"):
        explore(out, other)


def test_lens_ids_are_checked_and_a_one_entry_list_is_one_run(pair):
    out, _ = pair
    n, T = out.n_steps, out.tokens.shape[1]
    with pytest.raises(MDMLensError, match="lens_top1"):
        explore(out, lens_top1=torch.full((n, 2, T), -5, dtype=torch.long))
    top = torch.full((n, 2, T), 3, dtype=torch.long)
    assert _data(explore(out, lens_top1=[top]))[0]["lens"][0][0][0] == "#3"
