"""Replay and the probes on the block-diffusion families (LLaDA2.x, SDAR) and the bidirectional LLaDA-MoE.

Replay: a replayed step is the forward the sampler ran (same canvas, same state, logits equal to those it read).
Probes under a block mask: planted block-causal patterns where received attention and the uniform null are
computed by hand."""

from __future__ import annotations

import pytest
import torch
from family_checkpoints import write_llada2, write_lladamoe, write_sdar

from mdm_lens import HookedMDM
from mdm_lens.diffusion.generate import generate
from mdm_lens.errors import SamplerConfigError
from mdm_lens.hooks.runner import StepRunner
from mdm_lens.hooks.steps import at_steps


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("family_probes")
    return {"llada2": HookedMDM.from_pretrained(write_llada2(root / "llada2")[0]),
            "sdar": HookedMDM.from_pretrained(write_sdar(root / "sdar")[0]),
            "lladamoe": HookedMDM.from_pretrained(write_lladamoe(root / "lladamoe")[0])}


def _prompt(n: int) -> torch.Tensor:
    return torch.randint(0, 90, (1, n), generator=torch.Generator().manual_seed(n))


RUNS = {  # prompt 6 and gen 9 with blocks of 4: a straddling first block and a canvas tail past prompt + gen_length
    "llada2": dict(sampler="llada2", gen_length=9, block_length=4, steps=2, threshold=0.5),
    "sdar": dict(sampler="sdar", gen_length=9, block_length=4, steps=2, temperature=0.7, seed=3),
}


def _recorded_run(model, monkeypatch, **kw):
    """A run, and what every forward of it read: (state, logits) per step, taken inside StepRunner.forward."""
    seen = []
    inner = StepRunner.forward

    def forward(self, state, tokens, **kwargs):
        logits = inner(self, state, tokens, **kwargs)
        seen.append((state, tokens.clone(), logits.clone()))
        return logits

    monkeypatch.setattr(StepRunner, "forward", forward)
    out = generate(model, _prompt(6), **kw)
    monkeypatch.setattr(StepRunner, "forward", inner)
    return out, seen


@pytest.mark.parametrize("name", ["llada2", "sdar"])
def test_replay_is_the_forward_the_sampler_ran(models, monkeypatch, name):
    model = models[name]
    out, seen = _recorded_run(model, monkeypatch, **RUNS[name])
    assert len(seen) == out.n_steps
    kinds = set()
    for s, (state, tokens, logits) in enumerate(seen):
        lo, hi = state.extra["query_start"], state.extra["query_end"]
        kinds.add(state.extra["kind"])
        replayed = out.replay(model, s)
        assert replayed.shape[1] == hi  # position-aligned from 0 up to the forward's end
        assert torch.allclose(replayed[:, lo:hi], logits, atol=1e-5, rtol=0)
        assert tokens.shape[1] == hi - lo
        again = out.state_at(s)
        assert (again.step, again.block, again.n_blocks, again.block_slice) == (
            state.step, state.block, state.n_blocks, state.block_slice)
        # the run's hooks saw the bound; the rebuilt state counts the forwards the run made
        assert again.n_steps == out.trajectory.n_steps <= state.n_steps
        assert torch.equal(again.x, state.x) and torch.equal(again.masked, state.masked)
        assert torch.equal(again.prompt, state.prompt) and torch.equal(again.key_visible, state.key_visible)
        assert again.extra["kind"] == state.extra["kind"] and again.extra["replay_rows"] == (0, hi)
        assert (again.extra["query_start"], again.extra["query_end"]) == (lo, hi)
        if "kv_age" in state.extra:
            assert torch.equal(again.extra["kv_age"], state.extra["kv_age"])
    total = seen[0][0].x.shape[1]
    assert total == 16 and out.tokens.shape[1] == 15  # the canvas tail (position 15) is replayed too
    if name == "sdar":
        assert kinds == {"prefill", "denoise", "store"}
        assert seen[0][0].extra["query_start"] == 0 and any(st.extra["query_start"] > 0 for st, _, _ in seen)
    else:
        assert all(st.extra["query_start"] == 0 for st, _, _ in seen)


def test_replay_hooks_fire_with_the_step_state(models):
    model = models["sdar"]
    out = generate(model, _prompt(6), **RUNS["sdar"])
    got = []

    def fn(t, hook):
        got.append((model.state.step, model.state.extra["kind"], tuple(t.shape)))

    s = out.n_steps - 1
    out.replay(model, s, fwd_hooks=[("blocks.0.attn.hook_pattern", at_steps(fn, [s]))])
    out.replay(model, 0, fwd_hooks=[("blocks.0.attn.hook_pattern", at_steps(fn, [s]))])  # not its step
    assert got == [(s, "store", (1, model.cfg.n_heads, 16, 16))]


def test_replay_refuses_uncond_on_block_runs(models):
    out = generate(models["llada2"], _prompt(6), **RUNS["llada2"])
    with pytest.raises(SamplerConfigError, match="no CFG"):
        out.replay(models["llada2"], 0, phase="uncond")


# ---- cfg.n_params ------------------------------------------------------------------------------------------------
def _hub_numel(sd: dict, skip: str = "expert_bias") -> int:
    return sum(t.numel() for k, t in sd.items() if skip not in k)


def test_n_params_counts_experts_router_and_shared(tmp_path):
    from tiny_checkpoints import hf_reference, write_dream

    cases = {"llada2": write_llada2(tmp_path / "l2"), "lladamoe": write_lladamoe(tmp_path / "lm"),
             "sdar": write_sdar(tmp_path / "s"), "sdar_moe": write_sdar(tmp_path / "sm", moe=True)}
    for name, (folder, config, sd) in cases.items():
        model = HookedMDM.from_pretrained(folder)
        learned = sum(p.numel() for p in model.parameters())
        assert model.cfg.n_params == learned == _hub_numel(sd), name  # expert_bias: a buffer, not counted
        # the active count swaps every layer's routed experts for top_k of them
        moe, d = model.cfg.extra.get("moe"), model.cfg.d_model
        n_moe = sum(model.cfg.extra["moe_layers"])
        if moe is None:
            assert model.cfg.n_params_active == learned
        else:
            unused = n_moe * (moe["n_experts"] - moe["top_k"]) * 3 * d * moe["d_expert"]
            assert model.cfg.n_params_active == learned - unused, name
    dream = HookedMDM.from_pretrained(write_dream(hf_reference("dream"), tmp_path / "dream"))  # qkv biases
    assert dream.cfg.n_params == sum(p.numel() for p in dream.parameters())
    # the hand count for LLaDA2's tiny layout: 1 dense + 2 MoE layers, o/qkv bias, q/k norm, untied unembedding
    c = cases["llada2"][1]
    d, e, f = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    attn = d * e * (4 + 2 * 2) + 4 * e * d + e * (4 + 2 * 2) + d + 2 * e
    moe_mlp = 8 * d + 8 * 3 * d * 24 + 3 * d * 24
    assert HookedMDM.from_pretrained(cases["llada2"][0]).cfg.n_params == (
        3 * (attn + 2 * d) + 3 * d * f + 2 * moe_mlp + d + 2 * 101 * d)


# ---- received attention and its null under a block mask (planted) --------------------------------------------------
def test_block_causal_received_attention_and_null_by_hand():
    from mdm_lens.probes import floating
    from mdm_lens.probes.received import (received_attention, uniform_pattern, uniform_received,
                                          visibility_mask)

    # 4 keys in blocks of 2: queries 0, 1 see keys 0, 1; queries 2, 3 see every key
    vis = visibility_mask(4, 4, block_length=2)
    assert vis.tolist() == [[True, True, False, False]] * 2 + [[True] * 4] * 2
    # a cached block's rows (queries at absolute 2, 3) see all four keys
    assert visibility_mask(2, 4, block_length=2).all()
    assert torch.equal(uniform_pattern(4, block_length=2),
                       torch.tensor([[.5, .5, 0, 0], [.5, .5, 0, 0], [.25] * 4, [.25] * 4], dtype=torch.float64))
    # uniform null: mass (1/4) Σ_i 1/|V_i| over the queries that see j; not 1/4 each as without the mask
    assert torch.allclose(uniform_received(torch.ones(4, dtype=torch.bool), block_length=2),
                          torch.tensor([3 / 8, 3 / 8, 1 / 8, 1 / 8], dtype=torch.float64), atol=0, rtol=1e-15)
    assert torch.allclose(uniform_received(torch.ones(4, dtype=torch.bool), kind="visibility", block_length=2),
                          torch.tensor([3 / 8, 3 / 8, 1 / 4, 1 / 4], dtype=torch.float64), atol=0, rtol=1e-15)
    # a padded key (1) is nobody's: query 0 sees key 0 alone, queries 2, 3 see keys 0, 2, 3
    pad = torch.tensor([True, False, True, True])
    assert torch.allclose(uniform_received(pad, block_length=2),
                          torch.tensor([(1 + 1 / 3 + 1 / 3) / 3, 0, (1 / 3 + 1 / 3) / 3, (1 / 3 + 1 / 3) / 3],
                                       dtype=torch.float64))
    pattern = torch.tensor([[.9, .1, 0, 0], [.9, .1, 0, 0], [.1, .2, .3, .4], [.1, .2, .3, .4]],
                           dtype=torch.float64)
    mass = received_attention(pattern, block_length=2)
    assert torch.allclose(mass, torch.tensor([.5, .15, .15, .2], dtype=torch.float64))
    seen = received_attention(pattern, kind="visibility", block_length=2)  # key 2: only queries 2, 3 see it
    assert torch.allclose(seen, torch.tensor([.5, .15, .3, .4], dtype=torch.float64))
    res = floating.absorption_variants(mass, block_length=2)
    assert float(res.pos0) == pytest.approx(50.0) and float(res.null_pos0) == pytest.approx(37.5)
    assert float(res.excess_pos0) == pytest.approx(12.5)
    assert float(floating.absorption_variants(mass).null_pos0) == pytest.approx(25.0)  # 100/n: the unmasked null


def test_absorption_on_a_block_model_names_its_block_null(models):
    from mdm_lens.probes.absorption import absorption_by_layer
    from mdm_lens.probes.received import uniform_received

    model = models["llada2"]
    res = absorption_by_layer(model, _prompt(10))
    assert res.block_length == 32 == model.cfg.extra["block_length"]  # one block: the null is 100/n
    assert torch.allclose(res.null[..., 0], torch.full_like(res.null[..., 0], 10.0))
    model.cfg.extra["block_length"] = 4
    try:
        res = absorption_by_layer(model, _prompt(10))
    finally:
        model.cfg.extra["block_length"] = 32
    u = 100 * uniform_received(torch.ones(10, dtype=torch.bool), block_length=4)
    assert res.block_length == 4
    assert torch.allclose(res.null[..., 0], torch.full_like(res.null[..., 0], float(u[0])))  # pos0's null
    assert float(u[0]) > 10.0


def test_router_stats_on_block_runs_read_the_replayed_positions(models):
    from mdm_lens.probes import router_stats

    model = models["llada2"]
    out = generate(model, _prompt(6), **RUNS["llada2"])
    last = out.n_steps - 1
    table = router_stats(model, out, steps=[0, last]).table
    end = out.state_at(last).extra["query_end"]
    counts = table[(table.metric == "positions")].set_index(["step", "layer", "class"])["value"]
    layer = int(table.layer.dropna().iloc[0])
    # step 0 forwards the first decoded block's canvas (positions 0..7); the last step the whole canvas (16)
    assert counts[(0, layer, "prompt")] + counts[(0, layer, "canvas")] == out.state_at(0).extra["query_end"] == 8
    assert counts[(last, layer, "prompt")] + counts[(last, layer, "canvas")] == end == 16


def test_logit_lens_on_a_block_run_is_nan_past_the_step_forward(models):
    import torch.nn.functional as F

    from mdm_lens.lens.trace import lens_trace

    model = models["llada2"]
    out = generate(model, _prompt(6), **RUNS["llada2"])
    trace = lens_trace(model, out, layers=[model.cfg.n_layers - 1], steps=[0])
    end = out.state_at(0).extra["query_end"]  # 8: step 0 forwards the canvas of the first decoded block
    inside = [p for p in trace.positions if 6 + p < end]
    outside = [p for p in trace.positions if 6 + p >= end]
    assert inside == [0, 1] and outside == list(range(2, 9))
    assert bool(trace.final_prob[0, 0, 0, outside].isnan().all())
    # the last layer's logit lens is the replayed step's own distribution at the positions it computed
    probs = F.softmax(out.replay(model, 0)[0].double(), -1)
    want = probs[torch.tensor([6, 7]), out.tokens[0, 6:8]]
    assert torch.allclose(trace.final_prob[0, 0, 0, inside].double(), want, atol=1e-5)
