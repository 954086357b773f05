"""Every forward's rows carry their canvas positions (`DenoisingState.query_rows` / `key_cols`), and every consumer
maps rows to positions through them: hooks, the trajectory cache (`stack(align=True)`), `features_from_cache`,
the sweep's feature table, the SAE export and `out.replay` / `state_at` (issue #32 §3)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "families"))

from family_checkpoints import write_llada2, write_sdar  # noqa: E402
from test_fastdllm_v2 import write_fastdllm_v2  # noqa: E402

from mdm_lens import HookedMDM  # noqa: E402
from mdm_lens.diffusion.replay import replay_rows  # noqa: E402
from mdm_lens.errors import InputError, SamplerConfigError  # noqa: E402
from mdm_lens.lens import features_from_cache, lens_trace  # noqa: E402
from mdm_lens.sweep.feature_tables import masked_mean_residuals  # noqa: E402

PROMPT6 = [[20, 21, 22, 23, 24, 25]]
PROMPT30 = [[30, 31, 32, 33, 34, 35]]  # commits a sub-block's first position first: sub-block window forwards
RESID = "blocks.1.hook_resid_post"


def _realistic(folder: Path, seed: int = 1) -> HookedMDM:
    """The family's layout and config (from its hub-layout checkpoint) with realistic random weights."""
    cfg = HookedMDM.from_pretrained(str(folder), load_tokenizer=False).cfg
    return HookedMDM.from_config(cfg, seed=seed, init_std=0.05, init="realistic")


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    root = tmp_path_factory.mktemp("row_positions")
    return {"llada2": _realistic(write_llada2(root / "llada2")[0]), "sdar": _realistic(write_sdar(root / "sdar")[0]),
            "fastdllm_v2": _realistic(write_fastdllm_v2(root / "v2")[0])}


@pytest.fixture(scope="module")
def llada():
    """The shipped trained LLaDA-layout twin (a random model may sample the mask id, which stalls a schedule)."""
    return HookedMDM.from_pretrained("mdm-lens/tiny-mdm")


RUNS = {  # block layouts differing from the checkpoints' defaults (config facts are behaviour)
    "llada2": dict(sampler="llada2", gen_length=8, block_length=4, steps=4),
    "sdar": dict(sampler="sdar", gen_length=8, block_length=4, steps=4),
    "fastdllm_v2": dict(sampler="fastdllm_v2", block_size=4, small_block_size=4, max_new_tokens=8, stop_token=95,
                        pad_id=0),
    "fastdllm_v2_sub": dict(sampler="fastdllm_v2", block_size=4, small_block_size=2, max_new_tokens=8,
                            stop_token=95, pad_id=0, use_block_cache=True),
}
LLADA_RUNS = {
    "llada_semi_ar": dict(gen_length=8, steps=4, block_length=4),
    "kv_prefix": dict(gen_length=8, steps=8, block_length=4, kv_cache="prefix"),
    "kv_dual": dict(gen_length=8, steps=8, block_length=4, kv_cache="dual"),
}


def _row_checker(model, seen):
    """Hooks that check, at every forward, that the rows a hook sees are the state's query positions: the embedding
    rows are the embeddings of `x` at exactly those positions, the pattern's key axis the state's key columns."""
    def embed(t, hook):
        st = model.state
        r = st.rows
        assert t.shape[1] == r.stop - r.start
        torch.testing.assert_close(t, model.embed.W_E[st.x[:, r]].to(t.dtype))
        assert torch.equal(st.query_positions[0], torch.arange(r.start, r.stop))
        seen.append((st.step, r.start, r.stop))

    def pattern(t, hook):
        st = model.state
        assert t.shape[-2] == st.rows.stop - st.rows.start and t.shape[-1] == st.keys.stop - st.keys.start
        assert st.keys.start == 0 and st.keys.stop >= st.rows.stop
        assert torch.equal(st.key_positions[0], torch.arange(st.keys.stop))

    return [("hook_embed", embed), ("blocks.0.attn.hook_pattern", pattern)]


@pytest.mark.parametrize("name", list(RUNS))
def test_hook_rows_are_the_state_query_positions_family(fam, name):
    model = fam[name.replace("_sub", "")]
    seen: list = []
    out = model.generate(PROMPT30 if name.endswith("_sub") else PROMPT6, fwd_hooks=_row_checker(model, seen), **RUNS[name])
    assert len(seen) == out.n_steps
    starts = {s for _, s, _ in seen}
    # llada2 forwards the canvas prefix; sdar / fastdllm_v2 the prompt's whole block, then one block at a time
    assert starts == {"llada2": {0}, "sdar": {0, 4, 8, 12}}.get(name, starts)
    assert 0 in starts and all(s % (2 if name.endswith("_sub") else 4) == 0 for s in starts)
    assert len(starts) > 1 or name == "llada2"
    if name == "fastdllm_v2_sub":  # sub-block windows compute 2 rows of a 4-token block
        assert any(e - s == 2 for _, s, e in seen)


@pytest.mark.parametrize("name", list(LLADA_RUNS))
def test_hook_rows_are_the_state_query_positions_llada(llada, name):
    seen: list = []
    out = llada.generate([[11, 12, 13, 14, 15]], fwd_hooks=_row_checker(llada, seen),
                         **LLADA_RUNS[name])
    assert len(seen) == out.n_steps
    if name == "kv_dual":  # refresh forwards compute every row, the others the block [5 + 4b, 9 + 4b)
        assert {(s, e) for _, s, e in seen} == {(0, 13), (5, 9), (9, 13)}
    elif name == "kv_prefix":
        assert {(s, e) for _, s, e in seen} == {(0, 13), (5, 13), (9, 13)}
    else:
        assert {(s, e) for _, s, e in seen} == {(0, 13)}


def test_hook_rows_arm_twin():
    arm = HookedMDM.from_pretrained("mdm-lens/tiny-arm")
    seen: list = []
    out = arm.generate([[5, 6, 7]], gen_length=4, fwd_hooks=_row_checker(arm, seen))
    assert [(s, e) for _, s, e in seen] == [(0, 3), (0, 4), (0, 5), (0, 6)] and out.n_steps == 4


@pytest.mark.parametrize("name", ["llada2", "sdar", "fastdllm_v2"])
def test_cached_rows_aligned_equal_the_replayed_forward(fam, name):
    model = fam[name]
    out = model.generate(PROMPT6, cache=RESID, **RUNS[name])
    aligned = out.cache.stack(RESID, align=True)                          # [step, batch, pos, d]
    computed = out.cache.computed()
    assert bool(torch.isnan(aligned[~computed]).all()) and not bool(torch.isnan(aligned[computed]).any())
    checked = 0
    for s in out.cache.steps:
        got = {}
        out.replay(model, s, fwd_hooks=[(RESID, lambda t, hook: got.__setitem__("r", t.detach()))])
        rows = out.cache.rows_of(s)
        assert out.state_at(s).rows == rows                              # the run's own rows
        assert replay_rows(out, s) == slice(0, rows.stop)                # a replay forwards the prefix
        want = got["r"][:, rows.start:rows.stop]
        scale = float(want.abs().max())
        torch.testing.assert_close(aligned[s, :, rows.start:rows.stop], want, atol=1e-5 * scale, rtol=0)
        checked += 1
    assert checked == out.n_steps > 4


def test_stack_refuses_rows_at_different_positions(fam):
    out = fam["sdar"].generate(PROMPT6, cache=RESID, **RUNS["sdar"])
    with pytest.raises(InputError, match=r"step 0: \[0, 4\), step 1: \[4, 8\)"):
        out.cache.stack(RESID)
    assert out.cache.rows_of(1) == slice(4, 8) and out.cache.keys_of(1) == slice(0, 8)


def test_features_from_cache_pools_each_steps_computed_positions(fam):
    out = fam["sdar"].generate(PROMPT6, cache=RESID, **RUNS["sdar"])
    feats = features_from_cache(out.cache, layers=[1], pool="mean")
    for s in out.cache.steps:
        r = out.cache.rows_of(s)
        want = out.cache[s][RESID][0].mean(0)                             # the step's own rows, all computed
        torch.testing.assert_close(feats.acts[0, s, 0], want, atol=1e-5 * float(want.abs().max()), rtol=0)
    none = features_from_cache(out.cache, layers=[1], pool="none")
    assert bool(torch.isnan(none.acts[0, 1, 0, :4]).all()) and not bool(none.positions[1, 0, :4].any())
    assert bool(none.positions[1, 0, 4:8].all()) and out.cache.rows_of(1) == slice(4, 8)


def test_features_from_cache_excludes_pads(llada):
    ids = torch.tensor([[0, 0, 13, 14, 15], [16, 17, 18, 19, 20]])
    am = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    out = llada.generate(ids, attention_mask=am, gen_length=4, steps=2, cache=RESID)
    feats = features_from_cache(out.cache, layers=[1], pool="mean")
    stack = out.cache.stack(RESID)
    want = stack[:, 0, 2:].mean(1)                                         # row 0 without its two pads
    torch.testing.assert_close(feats.acts[0, :, 0], want, atol=1e-5, rtol=1e-5)
    with_pads = stack[:, 0].mean(1)
    assert float((with_pads - want).abs().max()) > 1e-3                  # the pads would change it
    torch.testing.assert_close(feats.acts[0, :, 1], stack[:, 1].mean(1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["llada2", "sdar", "fastdllm_v2"])
def test_feature_n_masked_equals_the_lens_tables(fam, name):
    model = fam[name]
    out = model.generate(PROMPT6, cache=RESID, **RUNS[name])
    pooled, n_masked, n_pooled = masked_mean_residuals(model, out)
    gen = out.tokens.shape[1] - out.prompt_length
    masked = out.trajectory.x_steps[:, :, out.prompt_length:out.prompt_length + gen] == model.cfg.mask_token_id
    assert torch.equal(n_masked, masked.sum(-1))
    if name != "fastdllm_v2":  # the lens reads llada / dream / llada2 / sdar runs
        trace = lens_trace(model, out, source="replay")
        assert torch.equal(n_masked, trace.masked.sum(-1))
    aligned = out.cache.stack(RESID, align=True)
    P = out.prompt_length
    for s in range(out.n_steps):
        rows = out.state_at(s).rows
        w = masked[s, 0].clone()
        w[max(rows.stop - P, 0):] = False                                 # computed rows only
        assert int(n_pooled[s, 0]) == int(w.sum()) <= int(n_masked[s, 0])
        if int(w.sum()) == 0:
            assert bool(torch.isnan(pooled[s, 1, 0]).all())
            continue
        # the cached step computed some of those rows; where it did, the pooled mean is theirs
        here = out.cache.computed()[s, 0, P:P + gen]
        if bool((w & ~here).any()):
            continue
        want = aligned[s, 0, P:P + gen][w].mean(0)
        torch.testing.assert_close(pooled[s, 1, 0], want, atol=1e-4 * float(want.abs().max()), rtol=0)
    assert int(n_masked[0, 0]) == gen                                     # step 0: every canvas position masked
    if name == "sdar":  # its step 0 is the prompt's prefill: 8 masked positions, none computed
        assert int(n_pooled[0, 0]) == 0 and bool(torch.isnan(pooled[0]).all())


def test_fastdllm_v2_replay_is_exact_and_sub_block_windows_are_refused(fam):
    model = fam["fastdllm_v2"]
    out = model.generate(PROMPT30, **RUNS["fastdllm_v2_sub"])
    kinds = [f["extra"].get("block_cache") for f in out.trajectory.forwards]
    window = kinds.index("window")
    with pytest.raises(SamplerConfigError, match="sub-block forward") as err:
        out.replay(model, window)
    assert "cache_effect" not in str(err.value) and "stale" in str(err.value)
    fill = kinds.index("fill")
    extra = out.trajectory.forwards[fill]["extra"]
    assert replay_rows(out, fill) == slice(0, extra["query_end"])
    assert out.state_at(fill).rows == slice(extra["query_start"], extra["query_end"])


@pytest.mark.parametrize("name", ["llada2", "sdar", "fastdllm_v2", "fastdllm_v2_sub"])
def test_state_at_is_the_state_the_runs_hooks_saw(fam, name):
    """misuse28 S1: `out.state_at(k)` is the state `model.state` held during step k (its rows, keys, block), not
    the replay's wider forward; the replay's own rows are `replay_rows(out, k)`."""
    model = fam[name.removesuffix("_sub")]
    seen: dict = {}

    def hook(x, hook):
        st = model.state
        seen[st.step] = (st.rows, st.keys, st.block, x.shape[1])

    out = model.generate(PROMPT30 if name.endswith("_sub") else PROMPT6, fwd_hooks=[(RESID, hook)], **RUNS[name])
    assert sorted(seen) == list(range(out.n_steps))
    narrower = 0
    for k, (rows, keys, block, n_rows) in seen.items():
        st = out.state_at(k)
        assert (st.rows, st.keys, st.block) == (rows, keys, block) and rows.stop - rows.start == n_rows
        narrower += replay_rows(out, k) != rows
    assert (narrower > 0) == (name != "llada2")  # SDAR / Fast-dLLM v2 forwarded blocks against a KV cache
