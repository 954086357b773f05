"""The shipped zoo twins load by name with the expected attention, and the training code runs."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mdm_lens.model import HookedMDM
from mdm_lens.zoo import data as D
from mdm_lens.zoo import evaluate as E
from mdm_lens.zoo import tokenizer as T
from mdm_lens.zoo import train as TR

TINY_ARCH = dict(d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, d_mlp=64)


@pytest.fixture(scope="module")
def twins() -> dict[str, HookedMDM]:
    return {k: HookedMDM.from_pretrained(f"mdm-lens/tiny-{k}") for k in ("mdm", "arm")}


def test_shipped_twins_load_by_name(twins: dict[str, HookedMDM]) -> None:
    mdm, arm = twins["mdm"], twins["arm"]
    assert mdm.cfg.attention == "bidirectional" and mdm.cfg.is_mdm
    assert arm.cfg.attention == "causal" and not arm.cfg.is_mdm
    assert mdm.cfg.model_name == "mdm-lens/tiny-mdm" and arm.cfg.model_name == "mdm-lens/tiny-arm"
    for m in (mdm, arm):
        c = m.cfg
        assert c.family == "mdm_lens" and c.dtype == torch.float32
        assert (c.d_vocab, c.mask_token_id, c.bos_token_id, c.eos_token_id, c.pad_token_id) == (
            T.vocab_size(), T.MASK_ID, T.BOS_ID, T.EOS_ID, T.PAD_ID)
        assert c.extra["gen_length"] == 4 and c.extra["prepend_bos"] is False
        assert m.tokenizer is not None
    same = ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_mlp", "d_vocab", "n_ctx", "rope_theta")
    assert all(getattr(mdm.cfg, f) == getattr(arm.cfg, f) for f in same)
    assert sum(p.numel() for p in mdm.parameters()) == sum(p.numel() for p in arm.parameters())


def test_shipped_twins_attention_kind_is_real(twins: dict[str, HookedMDM]) -> None:
    """Editing a late token changes early logits for the MDM only."""
    item = D.make_dataset(1, seed=5, n_distractors=2)[0]
    a = torch.tensor([T.encode(item.prompt) + [T.MASK_ID] * 4])
    b = a.clone()
    b[0, -5] = T.encode("kelmira")[0]
    for name, m in twins.items():
        with torch.no_grad():
            diff = (m(a)[0, :5] - m(b)[0, :5]).abs().max().item()
        assert (diff > 1e-4) if name == "mdm" else (diff == 0.0), (name, diff)


def test_shipped_twins_reproduce_reported_accuracy(twins: dict[str, HookedMDM]) -> None:
    """The shipped weights are the ones the README reports on: the first 100 held-out items score
    within sampling noise of ``assets/results.json`` (500 items)."""
    results = json.loads((TR.ASSETS / "results.json").read_text())
    items = D.make_dataset(100, seed=E.EVAL_SEED, n_distractors=E.EVAL_DISTRACTORS)
    for name, m in twins.items():
        reported = results[name]["eval"]["with_context"]["exact_match"]
        assert abs(E.accuracy(m, items)["exact_match"] - reported) <= 0.12, name


def test_both_twins_read_the_passage(twins: dict[str, HookedMDM]) -> None:
    """Both twins copy the answer out of a single passage far above closed-book chance (~4%), and
    without the passage they are back near chance: the accuracy comes from reading, not memory."""
    easy = D.make_dataset(60, seed=E.EVAL_SEED, n_distractors=0)
    closed = D.make_dataset(60, seed=E.EVAL_SEED, no_context=True)
    for name, m in twins.items():
        assert E.accuracy(m, easy)["exact_match"] >= 0.5, name
        assert E.accuracy(m, closed)["exact_match"] <= 0.2, name


def test_evaluation_sweeps_and_figures(twins: dict[str, HookedMDM], tmp_path) -> None:
    ev = E.evaluate(twins["arm"], n=8, distractor_sweep=(0, 2), position_sweep=(0, 4), hardness_sweep=(0.0, 1.0))
    assert set(ev) == {"with_context", "no_context", "distractors_0", "distractors_2", "gold_0", "gold_4",
                       "hard_0", "hard_1"}
    assert all(v["n"] == 8 for v in ev.values())
    paths = E.plot_evaluation({"arm": {"eval": {**ev, **{f"distractors_{k}": ev["distractors_0"] for k in
                                                          E.DISTRACTOR_SWEEP},
                                                **{f"gold_{p}": ev["gold_0"] for p in E.POSITION_SWEEP}}}}, tmp_path)
    assert [p.name for p in paths] == ["acc_distractors.png", "acc_position.png"]
    assert all(p.stat().st_size > 5000 for p in paths)


def test_wilson_interval_and_chance() -> None:
    lo, hi = E.binomial_ci(0.5, 100)
    assert lo < 0.5 < hi and abs((hi - lo) - 0.19) < 0.01  # ±1.96·sqrt(.25/100) ≈ ±0.098
    lo, hi = E.binomial_ci(0.0, 50)
    assert lo == pytest.approx(0.0, abs=1e-12) and 0 < hi < 0.1  # never a zero-width interval at 0
    assert 0.03 < E.type_chance() < 0.06


def test_canvas_answer() -> None:
    ans = T.encode("kelmira")[0]
    assert E.canvas_answer([ans, T.EOS_ID, T.EOS_ID, T.EOS_ID]) == "kelmira"
    assert E.canvas_answer([T.EOS_ID, ans, T.EOS_ID, ans]) == "kelmira"
    assert E.canvas_answer([T.EOS_ID] * 4) == ""


def test_sft_and_pretraining_regions() -> None:
    tc = TR.TrainConfig(batch_size=4, bucket=1)
    b = next(TR.batch_stream(tc))
    sft = torch.tensor([True, False, True, False])
    region = TR._regions(b, sft, tc.gen_length)
    for r in range(4):
        idx = region[r].nonzero()[:, 0].tolist()
        if sft[r]:
            assert idx == list(range(int(b.starts[r]), int(b.starts[r]) + 4))
        else:
            assert idx == list(range(1, int(b.lengths[r])))
        # the canvas is answer + <eos> padding, then <pad>
        s = int(b.starts[r])
        assert b.ids[r, s + 1 : s + 4].tolist() == [T.EOS_ID] * 3
        assert (b.ids[r, int(b.lengths[r]) :] == T.PAD_ID).all()


@pytest.mark.parametrize("fn", [TR.train_mdm, TR.train_arm])
def test_smoke_train_three_steps(fn, tmp_path) -> None:
    model, log = fn(steps=3, batch_size=8, warmup=2, log_every=1, val_every=0, verbose=False,
                    arch=TR.ArchConfig(**TINY_ARCH))
    assert log["steps_done"] == 3 and log["stopped_by"] == "steps" and len(log["history"]) == 3
    assert all(math.isfinite(e["loss"]) for e in log["history"])
    folder = TR.save_twin(model, tmp_path / "twin")
    back = HookedMDM.from_pretrained(str(folder))
    assert back.cfg.attention == model.cfg.attention
    assert back.cfg.extra["recipe"]["steps_done"] == 3
    items = D.make_dataset(3, seed=0, n_distractors=1)
    ids = torch.tensor([T.encode(items[0].prompt)])
    with torch.no_grad():
        torch.testing.assert_close(back(ids), model(ids), atol=2e-2, rtol=0)
    assert len(E.greedy_answer(back, items)) == 3


def test_time_budget_stops_training() -> None:
    _, log = TR.train_mdm(steps=50, minutes=0.0, batch_size=4, val_every=0, verbose=False,
                          arch=TR.ArchConfig(**TINY_ARCH))
    assert log["stopped_by"] == "time" and log["steps_done"] == 0


def test_train_cli_records_the_data_recipe(tmp_path) -> None:
    TR.main(["--which", "arm", "--steps", "3", "--batch-size", "4", "--no-eval", "--max-distractors", "1",
             "--hard-negative-frac", "1", "--curriculum", "0", "--out", str(tmp_path)])
    recipe = json.loads((tmp_path / "tiny-arm" / "config.json").read_text())["extra"]["recipe"]
    assert (recipe["max_distractors"], recipe["hard_negative_frac"], recipe["curriculum"]) == (1, 1.0, 0.0)
    assert recipe["steps_done"] == 3
    assert json.loads((tmp_path / "results.json").read_text())["arm"]["steps_done"] == 3
    assert (tmp_path / "training_curves.png").exists()
