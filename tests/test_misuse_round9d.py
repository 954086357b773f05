"""Held-out misuse16 findings (each test fails on the behaviour the audit met): block_length on a causal model,
n_steps of a rebuilt state after an adaptive run, explore's per-run lens list, stacking steps of the same rows,
knockout on MDLM's cache-reusing steps, and the no-op targets note."""

from __future__ import annotations

import warnings

import pytest
import torch

from mdm_lens import HookedMDM, steps
from mdm_lens.errors import ArgumentTypeError, InputError
from tests.test_misuse_round9 import _no_mask


@pytest.fixture(scope="module")
def tiny():
    return HookedMDM.from_pretrained("mdm-lens/tiny-mdm")


def test_block_length_on_a_causal_model_is_refused():
    arm = HookedMDM.from_pretrained("mdm-lens/tiny-arm")
    tok = torch.randint(5, 300, (1, 8), generator=torch.Generator().manual_seed(0))
    for bl in (4, 100):
        with pytest.raises(InputError, match="no effect on a causal model") as err:
            arm(tok, block_length=bl)
        assert err.value.argument == "block_length"
    assert arm(tok).isfinite().all()


def test_a_rebuilt_state_counts_the_forwards_an_adaptive_run_made(tmp_path):
    from tests.families.family_checkpoints import write_sdar

    m = HookedMDM.from_pretrained(str(write_sdar(tmp_path / "s")[0]), load_tokenizer=False)
    seen = []
    handle = _no_mask(m)
    try:
        out = m.generate([[5, 17, 33, 2, 61, 40, 9, 12, 44, 3]], gen_length=8, seed=0,
                         fwd_hooks=[("blocks.0.hook_resid_pre", lambda x, hook: seen.append(m.state.n_steps))])
    finally:
        handle.remove()
    n = out.trajectory.n_steps
    assert seen and seen[0] > n  # during the run the hooks see the bound
    assert all(out.state_at(k).n_steps == n for k in range(n))
    assert [out.state_at(k).is_last for k in range(n)] == [False] * (n - 1) + [True]


def test_explore_of_several_runs_refuses_one_lens_for_all(tiny):
    from mdm_lens import ReceivedAttention
    from mdm_lens.views import explore

    out = tiny.generate(tiny.to_tokens("what is the capital ?"), steps=4, gen_length=4, record=[ReceivedAttention()])
    with pytest.raises(ArgumentTypeError, match="one \\[step, layer, pos\\] token-id tensor") as err:
        explore([out, out], [tiny, tiny], lens_top1=9)
    assert err.value.argument == "lens_top1"


def test_steps_that_computed_the_same_rows_stack(tmp_path):
    from tests.families.family_checkpoints import write_sdar

    m = HookedMDM.from_pretrained(str(write_sdar(tmp_path / "s")[0]), load_tokenizer=False)
    handle = _no_mask(m)
    try:
        out = m.generate(torch.tensor([[5, 6, 7, 8, 9]]), gen_length=8, seed=0, temperature=0.7,
                         cache="blocks.0.hook_resid_post" @ steps(1, 2))
    finally:
        handle.remove()
    rows = [out.cache.rows_of(s) for s in (1, 2)]
    stacked = out.cache.stack("blocks.0.hook_resid_post")
    if rows[0] == rows[1]:
        assert stacked.shape[0] == 2
        for i, s in enumerate((1, 2)):
            torch.testing.assert_close(stacked[i], out.cache[s]["blocks.0.hook_resid_post"], rtol=0, atol=0)
        aligned = out.cache.stack("blocks.0.hook_resid_post", align=True)
        torch.testing.assert_close(aligned[:, :, rows[0]], stacked, rtol=0, atol=0)
    else:
        with pytest.raises(InputError, match="different canvas positions"):
            out.cache.stack("blocks.0.hook_resid_post")


def test_mdlm_knockout_reads_cache_reusing_steps_at_the_latest_forward():
    from mdm_lens.ddit import HookedDDiT, ddit_config
    from mdm_lens.probes import patching as PT

    warnings.simplefilter("ignore")
    cfg = ddit_config("mdlm", d_vocab=40, n_ctx=16, d_model=32, cond_dim=16, n_layers=2, n_heads=2,
                      time_conditioning=False)
    m = HookedDDiT.from_config(cfg, seed=0)
    p = torch.tensor([[3, 5, 7, 9]])
    cached = PT.knockout(m, p, gen_length=6, n_steps=6, predictor="ddpm_cache", targets=[1], n_random=0)
    fresh = PT.knockout(m, p, gen_length=6, n_steps=6, predictor="ddpm", targets=[1], n_random=0)
    ran = []
    out = m.generate(p, gen_length=6, steps=6, predictor="ddpm_cache", seed=0,
                     fwd_hooks=[("hook_embed", lambda x, hook: ran.append(m.state.step))])
    committed = set(out.trajectory.commit_step[out.trajectory.commit_step >= 0].tolist())
    assert committed - set(ran)  # some answer token was committed at a step that reused the cache
    assert torch.isfinite(cached.answer_logprob).all()
    # with no change in between, a reused p(x0) is the one a fresh forward computes: the two predictors agree
    torch.testing.assert_close(cached.answer_logprob, fresh.answer_logprob, atol=1e-5, rtol=0)


def test_the_noop_targets_note_does_not_blame_a_rule(tiny):
    from mdm_lens.probes import patching as PT

    r = PT.knockout(tiny, tiny.to_tokens("what is the capital ?"), steps=[0, 1], targets=[])
    note = dict(zip(r.conditions, r.condition_notes))["targets"]
    assert "no-op control" in note and "anchor" not in note
