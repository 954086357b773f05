"""Held-out misuse12 findings left after round 8a (S2, U1, U3, U4): each test fails on the behaviour the audit met."""

from __future__ import annotations

import warnings

import pytest
import torch

from mdm_lens import HookedMDM


@pytest.fixture(scope="module")
def bd3(tmp_path_factory):
    from tests.families.bd3gidd_checkpoints import BD3LM_CONFIG, write_bd3lm

    path = write_bd3lm(tmp_path_factory.mktemp("bd"), dict(BD3LM_CONFIG, model_length=32))[0]
    return HookedMDM.from_pretrained(str(path), load_tokenizer=False)


# prompt of 6 tokens, blocks of 4, 10 generated: block 0 all prompt, block 1 holds 2 generated positions, blocks 2-3
# hold 4 each. Steps counted by hand from the sampler's loop (misuse12 S2: the plan said 16 for a 10-step run).
@pytest.mark.parametrize("kw, planned", [
    (dict(steps=4), 0 + 2 + 4 + 4),                                  # first hitting: one commit a step
    (dict(steps=4, kv_cache=True), 1 + 3 + 5 + 5),                   # + one storing forward per block
    (dict(steps=3, kv_cache=True), 1 + 3 + 3 + 3),                   # blocks 2-3 keep a mask: never stored
    (dict(steps=4, first_hitting=False), 0 + 4 + 4 + 4),             # an upper bound (a block may end early)
    (dict(steps=4, first_hitting=False, kv_cache=True), 1 + 5 + 5 + 5),
])
def test_bd3lm_plan_counts_only_the_forwards_this_prompt_runs(bd3, kw, planned):
    warnings.simplefilter("ignore")
    p = torch.tensor([[1, 5, 7, 9, 2, 3]])
    plan = bd3.memory_plan(p, gen_length=10, **kw)
    assert plan.forwards == planned
    out = bd3.generate(p, gen_length=10, seed=0, **kw)
    if kw.get("first_hitting", True):
        assert out.n_steps == planned
        # the length is known in advance: is_last answers inside the run and is true exactly once
        seen = []
        bd3.generate(p, gen_length=10, seed=0, **kw,
                     fwd_hooks=[("blocks.0.hook_resid_post", lambda x, hook: seen.append(bd3.state.is_last))])
        assert seen.count(True) == 1 and seen[-1] is True
    else:
        assert out.n_steps <= planned


# --- misuse12 U1: MaskedCanvas on a DDiT without names_filter ----------------------------------------------------

@pytest.mark.parametrize("positions", ["masked", "unmasked"])
def test_masked_canvas_keeps_ddit_conditioning_hooks_whole(positions):
    from mdm_lens.ddit import HookedDDiT, ddit_config
    from mdm_lens.sae import MaskedCanvas

    # d_model equals the canvas length: an adaLN term [batch, d_model] has the shape a [batch, pos] test accepts
    cfg = ddit_config("mdlm", d_vocab=40, n_ctx=32, d_model=32, cond_dim=16, n_layers=2, n_heads=2,
                      time_conditioning=False)
    m = HookedDDiT.from_config(cfg, seed=0)
    tokens = torch.randint(0, 39, (2, 32), generator=torch.Generator().manual_seed(0))
    mc = MaskedCanvas(m, mask_rate=0.5, positions=positions, seed=3)
    _, acts = mc.run_with_cache(tokens)  # the default caches every hook, hook_sigma included
    noisy, masked = MaskedCanvas(m, mask_rate=0.5, seed=3).mask(tokens)
    keep = masked if positions == "masked" else ~masked
    _, full = m.run_with_cache(noisy)
    for name in ("hook_sigma", "hook_cond", "blocks.1.adaLN.hook_scale_msa", "final_adaLN.hook_shift"):
        torch.testing.assert_close(acts[name], full[name], rtol=0, atol=0)
    torch.testing.assert_close(acts["blocks.0.hook_resid_post"], full["blocks.0.hook_resid_post"][keep][None],
                               rtol=0, atol=0)


# --- misuse12 U3: a stacked view of a bias the checkpoint lacks says so --------------------------------------------

def test_stacked_view_of_a_missing_bias_names_the_reason_not_a_second_refusal(tmp_path):
    from mdm_lens.errors import ReadOnlyViewError
    from tests.families.family_checkpoints import write_sdar

    m = HookedMDM.from_pretrained(str(write_sdar(tmp_path / "s")[0]), load_tokenizer=False)
    for attr in ("b_Q", "b_O"):
        with pytest.raises(ReadOnlyViewError) as stacked:
            getattr(m, attr).add_(1)
        with pytest.raises(ReadOnlyViewError) as layer:
            getattr(m.blocks[0].attn, attr).add_(1)
        assert "no" in str(layer.value) and "bias" in str(layer.value)
        assert f"model.{attr}:" in str(stacked.value) and "instead" not in str(stacked.value)
        assert str(layer.value).split("view: ")[-1] in str(stacked.value)
    # a stack of real parameters still points to the per-layer view that writes through
    with pytest.raises(ReadOnlyViewError, match=r"edit model.blocks\[layer\].attn.W_Q"):
        m.W_Q.add_(1)


# --- misuse12 U4: a sweep conflict with a setting the sweep cannot pass names the sweep's own argument ---------------

def test_sweep_names_its_own_argument_when_a_sampler_default_conflicts(tmp_path):
    from mdm_lens.errors import SamplerConfigError
    from mdm_lens.sweep.runner import run
    from tests.test_misuse_round8a import _fastdllm_sweep_model

    model, data = _fastdllm_sweep_model(tmp_path, n_items=1)
    with pytest.raises(SamplerConfigError) as err:
        run(model, data, "accuracy", tmp_path / "sw", limit=1, gen_length=16, block_length=4, template="zoo",
            progress=False)
    text = str(err.value)
    assert err.value.argument == "block_length" and err.value.value == 4
    assert "keeps small_block_size at its default" in text and "block-length" in text
    assert "pass small_block_size= explicitly" not in text  # the sweep has no such option
    assert not (tmp_path / "sw").exists()
