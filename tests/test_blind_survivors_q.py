"""Blind list Q (issue #32 §1): a test for each mutant that survived the whole suite, failing on that mutant."""

from __future__ import annotations

import pytest
import torch

from mdm_lens import HookedMDM
from mdm_lens.errors import ArgumentError, SamplerConfigError
from mdm_lens.hooks import ReceivedAttention


def test_w1_sums_absolute_cdf_differences_of_both_signs():
    # CDF_p − CDF_q = [−.5, .5, .5, .5, 0]: W1 = 2 (moving .5 one step and .5 three steps); the signed sum is 1.
    # survivor drift-w1-signed-cdf-difference
    from mdm_lens.probes.drift import wasserstein1

    p, q = torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0]), torch.tensor([0.5, 0.0, 0.0, 0.0, 0.5])
    assert wasserstein1(p, q).item() == pytest.approx(2.0) == wasserstein1(q, p).item()


def test_noise_level_masked_queries_refuse_a_batch_row_without_a_mask():
    # one row holds masks, the other none: that row's query set is empty (survivor noise-level-masked-rows-check-weakened)
    from mdm_lens.ddit import HookedDDiT, ddit_config
    from mdm_lens.probes.noise_level import noise_level

    cfg = ddit_config("mdlm", d_vocab=41, n_ctx=16, d_model=32, cond_dim=24, n_layers=2, n_heads=4,
                      time_conditioning=True)
    model = HookedDDiT.from_config(cfg, seed=0, init="realistic")
    x = torch.randint(0, 40, (2, 16), generator=torch.Generator().manual_seed(0))
    x[0, -4:] = 40
    with pytest.raises(ArgumentError, match="some rows of tokens hold no \\[MASK\\]"):
        noise_level(model, x, [1.0], queries="masked")
    x[1, :2] = 40
    assert noise_level(model, x, [1.0], queries="masked").n_queries == 6


def test_the_explorer_leaves_an_arm_steps_own_new_key_empty_even_where_the_record_holds_zero():
    # at ARM step s the forward's input is prompt + s tokens: the key committed at step s is not in it
    # (survivor explore-arm-committed-key-visible)
    from mdm_lens.views.explore import _received

    arm = HookedMDM.from_pretrained("mdm-lens/tiny-arm")
    P, G = 5, 4
    out = arm.generate(torch.tensor([[7, 8, 9, 10, 11]]), steps=G, gen_length=G, record=[ReceivedAttention()])
    out.records["received_attention"] = out.records["received_attention"].nan_to_num(0.0)
    got = _received(out, 0, list(range(G)), max_heads=8, notes=[])
    for s in range(G):
        for layer_rows in got["values"][s]:
            for head_row in layer_rows:
                assert all(v is None for v in head_row[P + s:]) and all(v is not None for v in head_row[:P + s])


def test_diffusion_gemma_refuses_t_max_equal_to_t_min():
    # the schedule runs from t_max down to t_min: equal ends are no schedule (survivor dg-settings-t-equal-accepted)
    pytest.importorskip("transformers.models.diffusion_gemma")
    from mdm_lens.bridge import TransformersBridge
    from mdm_lens.bridge.tiny import tiny_diffusion_gemma

    model = TransformersBridge(tiny_diffusion_gemma(seed=0))
    prompt = torch.randint(2, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    with pytest.raises(SamplerConfigError, match="t_max must exceed t_min") as err:
        model.generate(prompt, max_new_tokens=16, max_denoising_steps=4, t_min=0.5, t_max=0.5)
    assert err.value.argument == "t_max"


def test_accuracy_band_from_lower_and_upper_bounds_is_drawn_at_those_bounds():
    # errors[name] of shape [2, n] are the band's lower and upper bounds, not distances from the curve
    # (survivor fig-accuracy-band-bounds-as-distances)
    import matplotlib.pyplot as plt
    import numpy as np

    from mdm_lens import views

    lower, upper = [0.4, 0.5, 0.65], [0.55, 0.8, 0.72]
    fig = views.accuracy_curves([0, 1, 2], {"MDM": [0.5, 0.6, 0.7]}, errors={"MDM": [lower, upper]})
    (band,) = fig.axes[0].collections
    ys = np.round(band.get_paths()[0].vertices[:, 1], 6)
    assert set(lower + upper) <= set(ys.tolist()) and ys.min() == 0.4 and ys.max() == 0.8
    plt.close(fig)


def test_a_list_of_overlapping_hook_names_expands_to_each_hook_once():
    # a name and a glob covering it: the hook is installed (and fires) once (survivor hook-names-list-duplicates)
    from mdm_lens.hooks.names import expand_names

    model = HookedMDM.from_pretrained("mdm-lens/tiny-mdm")
    names = expand_names(model, ["blocks.0.hook_resid_post", "blocks.0.hook_resid_*", "blocks.0.hook_resid_post"])
    assert names[0] == "blocks.0.hook_resid_post" and len(names) == len(set(names)) == 3
    calls: list = []
    model.generate([[5, 6, 7]], gen_length=2, steps=1,
                   fwd_hooks=[(["blocks.0.hook_resid_post", "blocks.0.hook_resid_*"], lambda t, hook: calls.append(hook.name))])
    assert sorted(calls) == sorted(set(calls)) and len(calls) == 3


def test_the_sweep_runs_an_arm_with_one_step_per_token():
    # the ARM decodes one token per step: the sweep passes gen_length as its steps, whatever its own steps setting
    # (survivor sweep-arm-steps-not-gen-length)
    from mdm_lens.sweep.batch import Settings
    from mdm_lens.sweep.lengths import _gen_kwargs

    arm = HookedMDM.from_pretrained("mdm-lens/tiny-arm")
    kw = _gen_kwargs(arm, Settings(gen_length=4, steps=2, block_length=None, keep_keys=1, n_random=2, exact=True))
    assert kw.get("steps", kw.get("n_steps")) == 4 and kw["gen_length"] == 4


def test_realistic_init_draws_the_router_expert_bias(tmp_path):
    # a zero expert_bias hides every bug that drops it: realistic init redraws MoE routers' expert_bias buffers
    # (survivor init-router-bias-not-redrawn)
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "families"))
    from family_checkpoints import write_llada2

    cfg = HookedMDM.from_pretrained(str(write_llada2(tmp_path / "l2")[0]), load_tokenizer=False).cfg
    model = HookedMDM.from_config(cfg, seed=4, init="realistic")
    biases = {n: b for n, b in model.named_buffers() if n.endswith("expert_bias")}
    assert biases and all(float(b.std()) > 0.01 and float(b.abs().min()) > 0 for b in biases.values())


def test_a_head_scoring_exactly_the_threshold_is_not_a_retrieval_head():
    # "heads scoring above threshold": a planted copy head scores exactly 1.0 (survivor retrieval-threshold-inclusive)
    from tests.probes.test_retrieval import NEEDLE, OTHER, P, copy_hook, emit_hooks, item, prompt, tiny

    from mdm_lens.probes import retrieval as RT

    model, p = tiny(), prompt()
    w = int(p[NEEDLE])
    hooks = [copy_hook(1, 2, lambda T: [P], NEEDLE), copy_hook(0, 1, lambda T: [P], OTHER),
             emit_hooks(model, lambda T: {P: w})]
    for threshold, listed in ((1.0, False), (0.999, True)):
        res = RT.retrieval_scores(model, [item(p, [w])], gen_length=1, fwd_hooks=hooks, threshold=threshold)
        assert float(res.scores[1, 2]) == 1.0 and ((1, 2) in res.above_threshold) == listed
