"""The probes that run their own forward of a run's step (patching, knockout) run the forward the block sampler ran:
the run's block length and the step forward's canvas extent, not the checkpoint's default block length (32 / 4 on
the tiny LLaDA2 / SDAR; the runs here use 4 / 8, so the two forwards differ)."""

from __future__ import annotations

import pytest
import torch
from family_checkpoints import write_llada2, write_sdar

from mdm_lens import HookedMDM
from mdm_lens.probes.patching import matched_canvases, patch_anchor_activations
from mdm_lens.probes.run import step_canvas, step_forward_kwargs

RUNS = {  # prompt 6, gen 9; blocks other than the checkpoints' defaults (llada2: 32, sdar: 4)
    "llada2": dict(sampler="llada2", block_length=4, threshold=0.5),
    "sdar": dict(sampler="sdar", block_length=8, temperature=0.7, seed=3),
}
# a step that commits; SDAR's step 2 (> steps=2: a block run has `steps` per block) is a KV-cached forward of the
# rows [8, 16) against the cached first block
STEP = {"llada2": 1, "sdar": 2}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("family_patch")
    return {"llada2": HookedMDM.from_pretrained(write_llada2(root / "llada2")[0]),
            "sdar": HookedMDM.from_pretrained(write_sdar(root / "sdar")[0])}


def _prompt(seed: int) -> torch.Tensor:
    return torch.randint(0, 90, (1, 6), generator=torch.Generator().manual_seed(seed))


def _logprob(logits: torch.Tensor, rows: torch.Tensor, target: torch.Tensor) -> float:
    """Mean log-softmax of the target at the rows (the `logprob` metric of a model without a readout shift)."""
    lp = torch.log_softmax(logits[0, rows].double(), -1)
    return float(lp.gather(-1, target[:, None]).mean())


@pytest.mark.parametrize("name", ["llada2", "sdar"])
def test_step_canvas_forward_is_the_replayed_step(models, name):
    model = models[name]
    block = RUNS[name]["block_length"]
    assert model.cfg.extra["block_length"] != block
    out = model.generate(_prompt(0), steps=2, gen_length=9, **RUNS[name])
    assert step_forward_kwargs(out) == {"block_length": block}
    differs = []
    for s in range(out.n_steps):
        x, am = step_canvas(out, s)
        replayed = out.replay(model, s)
        assert x.shape[1] == replayed.shape[1] == out.state_at(s).extra["query_end"]
        with torch.no_grad():
            ours = model(x, attention_mask=am, **step_forward_kwargs(out))
            default = model(out.trajectory.x_steps[s])  # what the probes ran before: the output's width, block 32
        assert torch.allclose(ours, replayed, atol=1e-5, rtol=0)
        w = min(default.shape[1], x.shape[1])
        differs.append(float((default[:, :w] - replayed[:, :w]).abs().max()))
    assert min(differs) > 1e-2, differs  # every step's canvas spans > 4 positions: the default mask differs


@pytest.mark.parametrize("name", ["llada2", "sdar"])
def test_a_no_op_patch_is_the_replayed_step(models, monkeypatch, name):
    """Patching the first canvas position's layer-0 residual (its token embedding, the same in the clean and the
    corrupted canvas: only the prompts differ) changes nothing: the patched metric and the clean metric both equal
    the metric of the replayed step's logits, and not the one of the checkpoint-default forward."""
    model = models[name]
    runs = []
    generate = model.generate
    monkeypatch.setattr(model, "generate", lambda *a, **k: runs.append(generate(*a, **k)) or runs[-1])
    step = STEP[name]
    res = patch_anchor_activations(model, _prompt(0), _prompt(1), step=step, layers=[0], component="resid_pre",
                                   positions=[6], metric="logprob", n_random=0, gen_length=9, n_steps=2,
                                   **RUNS[name])
    (out,) = runs
    assert res.step == step
    committed = out.trajectory.commit_step[0] == step
    assert bool(committed.any())
    rows, target = committed.nonzero().flatten(), out.tokens[0, committed]
    expected = _logprob(out.replay(model, step), rows, target)
    assert res.conditions == ["positions"] and res.n_positions.tolist() == [[1.0]]
    assert abs(res.clean_value - expected) <= 1e-5
    assert abs(float(res.value[0, 0]) - expected) <= 1e-5
    with torch.no_grad():
        default = model(out.trajectory.x_steps[step])
    assert abs(_logprob(default, rows, target) - expected) > 1e-3
    pair = matched_canvases(out, _prompt(1), step, model=model)
    assert pair.forward_kwargs == {"block_length": RUNS[name]["block_length"]} and pair.clean.shape[1] == out.state_at(step).extra["query_end"]


# ---- retrieval's records on SDAR's KV-cached forwards ------------------------------------------------------------
def test_topk_keys_on_sdar_are_the_cached_forwards_own_rows(models):
    """TopKKeys (retrieval's record) on an SDAR run: at every step, the rows of the forward's block
    [query_start, query_end) hold the top-2 keys and weights of that step's replayed pattern (keys = the cached
    finished blocks + the block, absolute positions); every other row is absent."""
    from mdm_lens.hooks import TopKKeys

    model = models["sdar"]
    out = model.generate(_prompt(0), steps=2, gen_length=9, record=[TopKKeys(k=2)], **{**RUNS["sdar"],
                                                                                       "block_length": 4})
    top, att = out.records["topk_keys"], out.records["topk_attention"]
    assert out.record_meta["topk_keys"]["steps"] == list(range(out.n_steps))
    starts = set()
    for s in range(out.n_steps):
        pats = {}
        hooks = [(f"blocks.{l}.attn.hook_pattern", lambda t, hook, l=l: pats.__setitem__(l, t.clone()))
                 for l in range(model.cfg.n_layers)]
        out.replay(model, s, fwd_hooks=hooks)
        lo, hi = out.state_at(s).extra["query_start"], out.state_at(s).extra["query_end"]
        starts.add(lo)
        for l in range(model.cfg.n_layers):
            value, key = pats[l][0, :, lo:hi].topk(2, -1)
            assert torch.equal(top[s, 0, l, :, lo:hi], key)
            assert torch.allclose(att[s, 0, l, :, lo:hi].float(), value.float(), atol=1e-5, rtol=0)
            assert bool((top[s, 0, l, :, :lo] == TopKKeys.ABSENT).all())
            assert bool((top[s, 0, l, :, hi:] == TopKKeys.ABSENT).all())
            assert bool(att[s, 0, l, :, :lo].isnan().all())
    assert len(starts) > 1 and max(starts) > 0  # cached forwards of later blocks were checked


def test_copy_at_final_reads_the_final_sequence_under_the_runs_block_mask(models):
    """retrieval's copy@final forward of a block run's final sequence runs under the run's block length (4): every
    position's argmax key lies in its own block or an earlier one; under the checkpoint's default (32: one block
    over these 15 positions) some argmax key lies in a later block."""
    from mdm_lens.probes.retrieval import _final_argmax

    model = models["llada2"]
    out = model.generate(_prompt(0), steps=2, gen_length=9, **RUNS["llada2"])
    tokens, layers = out.tokens[0], list(range(model.cfg.n_layers))
    block_end = (torch.arange(tokens.shape[0]) // 4 + 1) * 4                       # [query]
    ours = _final_argmax(model, tokens, layers, [], out.prompt_length, step_forward_kwargs(out))
    default = _final_argmax(model, tokens, layers, [], out.prompt_length)
    assert bool((ours < block_end).all())
    assert bool((default >= block_end).any())
