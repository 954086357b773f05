"""The noise-level probe (mdm_lens.probes.noise_level): planted patterns and gates with exact expected values, its
per-layer figures equal to what run_with_cache shows, its nulls under bidirectional and block-causal visibility,
and the meaning notes per family."""

from __future__ import annotations

import pytest
import torch

from mdm_lens.ddit import HookedDDiT, ddit_config
from mdm_lens.errors import ArgumentError
from mdm_lens.probes.noise_level import _reduce_layer, noise_level, plot_noise_level
from mdm_lens.probes.received import uniform_pattern


def _model(family="mdlm", tc=True, seed=0):
    cfg = ddit_config(family, d_vocab=41, n_ctx=16, d_model=32, cond_dim=24, n_layers=3, n_heads=4,
                      time_conditioning=tc)
    return HookedDDiT.from_config(cfg, seed=seed, init_std=0.3, init="realistic")


def _canvas(n_mask=6):
    x = torch.randint(0, 40, (2, 16), generator=torch.Generator().manual_seed(0))
    if n_mask:
        x[:, -n_mask:] = 40
    return x


def test_planted_spike_bidirectional():
    n = 8
    pattern = torch.full((1, 2, n, n), 0.3 / (n - 1))
    pattern[..., 2] = 0.7
    r = _reduce_layer(pattern, torch.ones(1, n, dtype=torch.bool), uniform_pattern(n))
    assert torch.allclose(r["anchor_share"], torch.tensor(0.7, dtype=torch.float64))
    assert torch.allclose(r["null_share"], torch.tensor(1 / n, dtype=torch.float64))
    assert torch.equal(r["n_anchors"], torch.ones(1, 2, dtype=torch.float64))
    assert torch.allclose(r["top1_share"], torch.tensor(0.7, dtype=torch.float64))


def test_uniform_attention_has_no_anchor_and_an_undefined_share():
    n = 8
    r = _reduce_layer(torch.full((1, 1, n, n), 1 / n), torch.ones(1, n, dtype=torch.bool), uniform_pattern(n))
    assert bool(r["anchor_share"].isnan().all()) and float(r["n_anchors"].sum()) == 0


def test_block_causal_null_is_the_masks_own_share():
    # n = 4, blocks of 2: rows 0-1 spread 1/2 over keys 0-1, rows 2-3 1/4 over all → u_0 = (1/2+1/2+1/4+1/4)/4
    pattern = torch.zeros(1, 1, 4, 4)
    pattern[..., 0] = 1.0
    r = _reduce_layer(pattern, torch.ones(1, 4, dtype=torch.bool), uniform_pattern(4, block_length=2))
    assert float(r["null_share"]) == pytest.approx(0.375)
    assert float(r["anchor_share"]) == pytest.approx(1.0)


def test_planted_gates():
    model = _model()
    d = model.cfg.d_model
    with torch.no_grad():
        for block in model.blocks:
            block.adaLN.linear.weight.zero_()
            block.adaLN.linear.bias.zero_()
            block.adaLN.linear.bias[2 * d:3 * d] = 0.5  # gate_msa
            block.adaLN.linear.bias[5 * d:6 * d] = -2.0  # gate_mlp
    r = noise_level(model, _canvas(), [0.0, 3.0])
    assert torch.allclose(r.gate_msa, torch.full((2, 3), 0.5, dtype=torch.float64))
    assert torch.allclose(r.gate_mlp, torch.full((2, 3), 2.0, dtype=torch.float64))


def test_figures_equal_run_with_cache_and_move_with_sigma():
    model = _model(seed=3)
    x = _canvas()
    r = noise_level(model, x, [0.5, 5.0], queries="masked")
    for i, s in enumerate((0.5, 5.0)):
        _, cache = model.run_with_cache(x, sigma=s)
        for layer in range(3):
            assert float(r.gate_msa[i, layer]) == pytest.approx(
                float(cache[f"blocks.{layer}.adaLN.hook_gate_msa"].abs().mean()), rel=1e-6)
            pat = cache[f"blocks.{layer}.attn.hook_pattern"].double()
            m = pat[:, :, -6:, :].mean(2)  # masked queries are the last 6 rows
            assert float(r.top1_share[i, layer]) == pytest.approx(float(m.max(-1).values.mean()), rel=1e-6)
    assert (r.gate_msa[0] - r.gate_msa[1]).abs().max() > 1e-3  # σ reaches the gates of a time-conditioned model
    assert r.n_queries == 12 and r.level_name == "sigma"


def test_without_time_conditioning_rows_repeat_and_the_result_says_so():
    model = _model(tc=False)
    r = noise_level(model, _canvas(), [0.0, 7.0])
    assert torch.equal(r.gate_msa[0], r.gate_msa[1]) and torch.equal(r.top1_share[0], r.top1_share[1])
    assert "time_conditioning is off" in r.meaning


def test_duo_has_no_masked_queries_and_says_what_anchors_mean():
    model = _model("duo")
    with pytest.raises(ArgumentError, match="queries='all'"):
        noise_level(model, _canvas(0), [1.0], queries="masked")
    r = noise_level(model, _canvas(0), [1.0])
    assert "uniform-state" in r.meaning and "1/T" in r.meaning


def test_refusals_and_figure():
    model = _model()
    with pytest.raises(ArgumentError, match="no \\[MASK\\]"):
        noise_level(model, _canvas(0), [1.0], queries="masked")
    with pytest.raises(ArgumentError, match="empty"):
        noise_level(model, _canvas(), [])
    with pytest.raises(ArgumentError, match="DDiT models"):
        noise_level(torch.nn.Linear(2, 2), _canvas(), [1.0])
    r = noise_level(model, _canvas(), [0.0, 1.0, 2.0], layers=[0, 2])
    assert r.anchor_share.shape == (3, 2) and len(r.table()) == 6
    fig = plot_noise_level(r)
    assert len(fig.axes) == 3 and len(fig.axes[0].lines) == 4  # share + null per layer


def _bd3lm(seed=0):
    from mdm_lens.ddit.bd3lm import HookedBD3LM

    cfg = ddit_config("bd3lm", d_vocab=41, n_ctx=16, d_model=32, cond_dim=24, n_layers=2, n_heads=4,
                      time_conditioning=True, block_size=4)
    cfg.mask_token_id, cfg.extra["parameterization"] = 40, "subs"
    return HookedBD3LM.from_config(cfg, seed=seed, init_std=0.3, init="realistic")


def test_bd3lm_uses_the_block_causal_null():
    model = _bd3lm()
    x = _canvas(3)
    r = noise_level(model, x, [1.0], queries="all")
    _, cache = model.run_with_cache(x, sigma=1.0)
    q = torch.ones(2, 16, dtype=torch.bool)
    for layer in range(2):
        pat = cache[f"blocks.{layer}.attn.hook_pattern"]
        want = _reduce_layer(pat, q, uniform_pattern(16, block_length=4))
        other = _reduce_layer(pat, q, uniform_pattern(16))
        assert float(r.null_share[0, layer]) == pytest.approx(float(want["null_share"].nanmean()), rel=1e-9)
        assert float(r.n_anchors[0, layer]) == pytest.approx(float(want["n_anchors"].mean()), rel=1e-9)
        assert not torch.equal(want["null_share"].nan_to_num(-1), other["null_share"].nan_to_num(-1))
    assert "block-causal" in r.meaning


def test_gidd_levels_are_times_and_the_meaning_names_the_hybrid_noise():
    from mdm_lens.ddit.gidd import HookedGIDD

    cfg = ddit_config("gidd", d_vocab=41, n_ctx=16, d_model=32, cond_dim=24, n_layers=2, n_heads=4,
                      time_conditioning=True, p_uniform=0.2, t_eps=1e-4)
    cfg.mask_token_id, cfg.extra["parameterization"] = 40, "gidd"
    model = HookedGIDD.from_config(cfg, seed=1, init_std=0.3)
    r = noise_level(model, _canvas(), [0.1, 0.9], queries="masked")
    assert r.level_name == "t" and "p_uniform=0.2" in r.meaning
    assert (r.gate_mlp[0] - r.gate_mlp[1]).abs().max() > 1e-3
