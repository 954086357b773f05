"""Regression tests for what a held-out misuse audit found silently wrong or crashing (each case as found, then
the class it belongs to)."""

from __future__ import annotations

import warnings

import pytest
import torch

from mdm_lens import ArgumentError, HookedMDM, InputError, MDMConfig, ReceivedAttention, SamplerConfigError
from mdm_lens.diffusion.arguments import IdleStepsWarning
from mdm_lens.probes import cache_effect, qk, retrieval
from mdm_lens.probes import floating as F
from mdm_lens.probes import run as R


@pytest.fixture(scope="module")
def twins():
    return HookedMDM.from_pretrained("mdm-lens/tiny-mdm"), HookedMDM.from_pretrained("mdm-lens/tiny-arm")


def test_the_mass_over_an_empty_query_set_is_nan_not_zero(twins):
    mdm, arm = twins
    ids = mdm.to_tokens(["where is ketterby ?"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IdleStepsWarning)
        out = mdm.generate(ids, steps=5, gen_length=4, record=[ReceivedAttention(query="masked", name="rm")])
    rec = out.records["rm"]  # step 4 of 5 is idle: nothing masked is left to average over
    assert rec[4].isnan().all() and not rec[:4].isnan().any()
    torch.testing.assert_close(rec[:4].sum(-1), torch.ones_like(rec[:4].sum(-1)), atol=1e-5, rtol=0)
    prompt = arm.to_tokens(["where is ketterby ?"])
    for kind in ("mass", "cumulative"):  # an ARM run has no masked query at all: asking for one is refused
        with pytest.raises(SamplerConfigError) as e:
            arm.generate(prompt, gen_length=3, record=[ReceivedAttention(query="masked", kind=kind, name="rm")])
        assert e.value.argument == "query"


def test_a_run_is_refused_with_another_model(twins):
    mdm, arm = twins
    ids = mdm.to_tokens(["where is ketterby ?"])
    out = mdm.generate(ids, steps=4, gen_length=4)
    from mdm_lens.lens import lens_trace

    for call in (lambda: out.replay(arm, 0), lambda: lens_trace(arm, out)):
        with pytest.raises(InputError, match="not by the model given"):
            call()
    other = HookedMDM.from_config(MDMConfig(d_model=16, n_layers=1, n_heads=2, d_mlp=16, d_vocab=20,
                                            mask_token_id=19, n_ctx=40), seed=0)
    cached = other.generate(torch.tensor([[3, 4, 5]]), gen_length=4, steps=4, kv_cache="dual")
    with pytest.raises(InputError, match="not by the model given"):
        cache_effect(mdm, cached)
    out.replay(mdm, 0)  # the model that ran it is fine


def test_qk_shares_are_nan_where_the_anchor_has_no_advantage():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 5, 2, 4, generator=g)
    k = torch.randn(1, 5, 2, 4, generator=g)
    k[0, 0] = -4 * q[0].mean(0)  # key 0 is attended less than the others by every query: no advantage
    res = qk.decompose(q, k, anchor=0)
    assert (res.advantage <= 0).all()
    assert res.norm_share.isnan().all() and res.angle_share.isnan().all()
    k[0, 0] = 4 * q[0].mean(0)
    res = qk.decompose(q, k, anchor=0)
    ok = res.advantage > 0
    assert ok.any() and torch.allclose(res.norm_share[ok] + res.angle_share[ok], torch.ones_like(res.norm_share[ok]))


def test_retrieval_items_without_a_needle_are_not_scored_zero(twins):
    mdm, _ = twins
    ids = mdm.to_tokens(["where is ketterby ?"])[0]
    item = retrieval.RetrievalItem(ids, evidence=[], answer="ketterby")
    res = retrieval.retrieval_scores(mdm, [item], only_correct=False)
    assert res.scores.isnan().all() and res.n_counted == 0
    assert any("no needle" in n for n in res.notes)


def test_a_text_answer_with_unknown_tokens_is_refused(twins):
    mdm, _ = twins
    ids = mdm.to_tokens(["where is ketterby ?"])
    from mdm_lens.probes import knockout

    with pytest.raises(InputError, match="unknown token"):
        knockout(mdm, ids, answer="日本語", steps=[0])


def test_dream_alg_temp_with_origin_is_refused():
    dream = HookedMDM.from_config(MDMConfig(d_model=16, n_layers=1, n_heads=2, d_mlp=16, d_vocab=20,
                                            mask_token_id=19, n_ctx=40, logit_shift=True), seed=0)
    with pytest.raises(SamplerConfigError) as info:
        dream.generate(torch.tensor([[3, 4]]), gen_length=4, alg_temp=0.5)
    assert info.value.argument == "alg_temp"
    dream.generate(torch.tensor([[3, 4]]), gen_length=4, alg="entropy", alg_temp=0.5)


def test_received_attention_refuses_scores_and_sums_over_heads(twins):
    mdm, _ = twins
    _, cache = mdm.run_with_cache(mdm.to_tokens(["where is ketterby ?"]))
    with pytest.raises(ArgumentError, match="not attention probabilities"):
        F.received_attention(cache["attn_scores", 1].mean(1))
    with pytest.raises(ArgumentError, match="not attention probabilities"):
        F.received_attention(cache["pattern", 1].sum(1))
    r = F.received_attention(cache["pattern", 1].mean(1))
    torch.testing.assert_close(r.sum(-1), torch.ones_like(r.sum(-1)), atol=1e-5, rtol=0)


def test_results_have_to_frame_and_misspelt_options_are_typed(twins):
    mdm, _ = twins
    small = HookedMDM.from_config(MDMConfig(d_model=16, n_layers=1, n_heads=2, d_mlp=16, d_vocab=20,
                                            mask_token_id=19, n_ctx=40), seed=0)
    out = small.generate(torch.tensor([[3, 4, 5]]), gen_length=4, steps=4, kv_cache="dual")
    assert cache_effect(small, out).to_frame().equals(cache_effect(small, out).table)
    rec = mdm.generate(mdm.to_tokens(["where is ketterby ?"]), steps=4, gen_length=4, record=[ReceivedAttention()])
    with pytest.raises(ArgumentError, match="detect_kwargs"):
        R.drift_from_output(rec, layer=0, foo=1)


def test_a_text_prompt_the_tokenizer_cannot_spell_warns(twins):
    mdm, _ = twins
    with pytest.warns(UserWarning, match="cannot spell: \\[2\\] unknown"):
        mdm.generate("hello world", gen_length=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        mdm.generate("where is ketterby ?", gen_length=4)


def test_a_report_never_mixes_one_models_sweeps_of_other_data(mdm, tmp_path):
    from mdm_lens import sweep
    from mdm_lens.views.sweep_report import find_sweeps
    from mdm_lens.zoo import jsonl

    for name, seed, n in (("a", 1, 2), ("b", 2, 3)):
        data = tmp_path / f"{name}.jsonl"
        jsonl.export(data, n, seed=seed)
        sweep.run(mdm, data, "accuracy", tmp_path / "sweeps" / name, progress=False)
    sweeps, left = find_sweeps(tmp_path / "sweeps")
    assert sorted(s.label for s in sweeps) == ["tiny-mdm (a)", "tiny-mdm (b)"] and not left
    assert sorted(len(s.table("accuracy").item_id.unique()) for s in sweeps) == [2, 3]


@pytest.mark.parametrize("kv", ["prefix", "dual"])
def test_kv_cached_runs_are_not_replayed_or_lensed_as_fresh_forwards(twins, kv):
    """A replay is a fresh full forward; a cached run's forwards read stale keys/values (the committed greedy token
    need not be the replayed argmax), so both are refused rather than answered with another forward's numbers."""
    mdm, _ = twins
    from mdm_lens.lens import lens_trace

    out = mdm.generate(torch.tensor([[5, 6, 7, 8, 9, 10]]), gen_length=8, block_length=4, steps=4, kv_cache=kv)
    with pytest.raises(SamplerConfigError, match="kv_cache"):
        out.replay(mdm, 1)
    with pytest.raises(InputError, match="kv_cache"):
        lens_trace(mdm, out)
