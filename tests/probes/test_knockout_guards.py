"""Knockout and router guards on planted values (issue 32 B, C): the score hook's fallback for a query row whose
every visible key is cut (exact output), a random control that cannot be matched is flagged per row, a knockout
that cuts nothing equals clean on every block family (counts exactly, log-probs to fp32 rounding: the hooked
attention path against the fused one) (SDAR's cached forwards were scored as rows 0.. and
gave NaN), and LLaDA2's router entropy renormalises its sigmoid scores before the entropy."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "families"))
from family_checkpoints import write_llada2, write_sdar  # noqa: E402
from mdm_lens import HookedMDM, MDMConfig
from mdm_lens.probes.knockout import KnockoutHooks, knockout
from mdm_lens.probes.router import router_stats

NEG = float("-inf")


def _llada(**kw) -> HookedMDM:
    cfg = MDMConfig(d_model=32, n_layers=2, n_heads=2, n_kv_heads=2, d_mlp=48, d_vocab=50, mask_token_id=49,
                    n_ctx=32, eos_token_id=1, pad_token_id=0, **kw)
    return HookedMDM.from_config(cfg, seed=5, init_std=0.2, init="realistic")


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    root = tmp_path_factory.mktemp("ko")
    return {"llada": _llada(),
            "llada2": HookedMDM.from_pretrained(str(write_llada2(root / "l2", seed=4)[0]), load_tokenizer=False),
            "sdar": HookedMDM.from_pretrained(str(write_sdar(root / "sd", seed=4)[0]), load_tokenizer=False)}


def test_a_row_whose_every_visible_key_is_cut_keeps_its_scores_exactly(families):
    ko = KnockoutHooks(families["llada"], layers=[0], targets=[0, 1])
    scores = torch.tensor([[[[1.0, 2.0, NEG], [3.0, 4.0, 5.0], [6.0, NEG, 7.0]]]])  # [batch, head, query, key]
    ko._rows = torch.tensor([[True, True, False]])  # rows 0, 1 are cut; row 2 is not a query row
    out = ko._score_hook(0)(scores.clone(), None)
    assert torch.equal(out[0, 0, 0], scores[0, 0, 0])  # keys 0, 1 were its only visible keys: left as it was
    assert torch.equal(out[0, 0, 1], torch.tensor([NEG, NEG, 5.0]))
    assert torch.equal(out[0, 0, 2], scores[0, 0, 2])
    assert ko.rows_kept == {0: 1}
    assert ko.n_knocked == {0: 2.0}


def test_an_unmatched_random_control_is_flagged_per_row(families):
    model = families["llada"]
    prompt = torch.tensor([[5, 6, 7]])
    # 5 positions; 4 targets: the random control can cut at most the one other visible key
    res = knockout(model, prompt, targets=[0, 1, 2, 3], gen_length=2, n_steps=2, n_random=2, layers=[0])
    table = res.table()
    assert list(table.index) == ["clean", "targets", "random"]
    assert "unmatched control" in table.loc["random", "note"]
    assert table.loc["targets", "note"] == "" and table.loc["clean", "note"] == ""
    assert float(res.n_targets[2].max()) <= 1.0 < float(res.n_targets[1].min())


def test_a_matched_random_control_has_no_note(families):
    res = knockout(families["llada"], torch.tensor([[5, 6, 7, 8, 9, 10]]), targets=[0], gen_length=2, n_steps=2,
                   n_random=1, layers=[0])
    assert res.table()["note"].tolist() == ["", "", ""]


@pytest.mark.parametrize("family,kw", [("llada", {}), ("llada2", dict(sampler="llada2", block_length=2)),
                                       ("sdar", dict(sampler="sdar", block_length=2))])
def test_a_knockout_that_cuts_nothing_equals_clean_exactly(families, family, kw):
    model = families[family]
    prompt = torch.tensor([[11, 12, 13, 14, 15]])
    res = knockout(model, prompt, targets=[], n_random=0, gen_length=4, n_steps=4, **kw)
    assert res.conditions == ["clean", "targets"]
    assert math.isfinite(float(res.value[0]))
    for name in ("answer_rank", "exact_match", "agreement", "accuracy"):  # counts: exact (NaN = NaN: no answer)
        a, b = getattr(res, name).tolist()
        assert a == b or (math.isnan(a) and math.isnan(b)), name
    # log-probs: the hooked attention path against the fused one, fp32 rounding only
    assert float(res.effect[1]) == pytest.approx(0.0, abs=1e-5 * abs(float(res.value[0])))
    assert res.condition_notes[0] == "" and res.condition_notes[1].startswith("nothing cut")  # said, not silent


@pytest.mark.parametrize("targets", ["anchors", [0, 1]])
def test_sdar_knockout_values_are_finite(families, targets):
    res = knockout(families["sdar"], torch.tensor([[11, 12, 13, 14, 15]]), targets=targets, n_random=1,
                   gen_length=4, n_steps=4, sampler="sdar", block_length=2)
    assert bool(torch.isfinite(res.value).all()), (res.value, res.condition_notes)


def test_llada2_router_entropy_renormalises_the_sigmoid_scores(families):
    model = families["llada2"]
    out = model.generate(torch.tensor([[11, 12, 13]]), sampler="llada2", gen_length=2, block_length=2, steps=2)
    n_experts = 8
    planted = torch.zeros(n_experts)
    planted[0], planted[1] = math.log(3), -math.log(3)  # sigmoid: 0.75, 0.25, then 0.5 × 6 (sum 4)

    def plant(logits, hook):
        return planted.to(logits).expand_as(logits).clone()

    moe = [i for i, b in enumerate(model.blocks) if hasattr(b.mlp, "hook_router_logits")]
    hooks = [(f"blocks.{l}.mlp.hook_router_logits", plant) for l in moe]
    table = router_stats(model, out, steps=[0], fwd_hooks=hooks).table
    p = [0.75 / 4, 0.25 / 4] + [0.5 / 4] * 6
    expected = -sum(q * math.log(q) for q in p)
    got = table[table["metric"] == "router_entropy"]["value"].tolist()
    assert got == pytest.approx([expected] * len(moe), rel=1e-6)  # fp32 logits
    assert expected != pytest.approx(math.log(8))  # not the uniform distribution a softmax-free bug would give
