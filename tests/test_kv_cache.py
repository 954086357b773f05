"""Fast-dLLM's approximate KV caches on LLaDA (`kv_cache="prefix"|"dual"`).

1. The cache itself: a cached forward equals an uncached forward whose keys/values at the cached positions are
   replaced, through hooks, by their block-start values (every layer).
2. Trajectories token-exact against transcriptions of NVlabs/Fast-dLLM @ 24cc59e `generate_with_prefix_cache` /
   `generate_with_dual_cache` (+ the threshold rule of `get_transfer_index` and the factor rule of the later
   `get_transfer_index_dynamic`), the cached model emulated by (1), which never touches `mdm_lens.kvcache`.
3. Observability: window rows in the hooks, keys in the patterns, per-position cache age, refresh flags."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mdm_lens import (HookedMDM, MDMConfig, ReceivedAttention, SamplerConfigError,
                      TrajectoryCache, at_steps, steps)
from mdm_lens.kvcache import KVCache
from sampler_rigs import identity_unembed, no_mask_hooks

MASK = 19
NO_MASK = no_mask_hooks(MASK)
PROMPT = torch.tensor([[3, 4, 5, 6, 7]])




def _model(dtype=torch.float32):
    cfg = MDMConfig(d_model=24, n_layers=2, n_heads=4, n_kv_heads=2, d_mlp=16, d_vocab=20, mask_token_id=MASK,
                    n_ctx=40, eos_token_id=1, dtype=dtype)
    m = HookedMDM.from_config(cfg, seed=7, init_std=0.6)
    return identity_unembed(m)


@pytest.fixture(scope="module")
def model():
    return _model()


# --- 1. the cache is a hook substitution ------------------------------------------------------------------

def _kv_names(model):
    return [f"blocks.{i}.attn.{h}" for i in range(model.cfg.n_layers) for h in ("hook_rot_k", "hook_v")]


def fill_kv(model, x):
    """Every layer's post-rotary keys and values of a full forward (the block-start forward)."""
    _, cache = model.run_with_cache(x, names_filter=lambda n: n.endswith(("hook_rot_k", "hook_v")))
    return {n: cache[n].clone() for n in _kv_names(model)}


def substituted(model, x, stale, keep):
    """Uncached forward whose keys/values outside `keep` (a [pos] bool) are the stale block-start values."""
    def put(t, hook):
        return torch.where(keep[None, :, None, None], t, stale[hook.name])

    hooks = [(n, put) for n in _kv_names(model)] + NO_MASK
    return model.run_with_hooks(x, return_type="aligned", fwd_hooks=hooks)


def _canvas(seed, total=13, n_masked=6):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, MASK, (1, total), generator=g)
    x[0, -n_masked:] = MASK
    return x


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("mode", ["prefix", "dual"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cached_forward_equals_the_hook_substituted_forward(mode, seed, dtype):
    model = _model(dtype)
    x0 = _canvas(seed)
    total, start, end = x0.shape[1], 7, 10
    x1 = x0.clone()
    x1[0, 7:12] = torch.tensor([2, 3, 4, 5, 6])  # the canvas moved on since the block start (also after the block)
    stale = fill_kv(model, x0)
    cache = KVCache(model, total)
    with torch.no_grad():
        with cache.attached("fill", (0, total)):
            model.run_with_hooks(x0, fwd_hooks=NO_MASK)
        if mode == "prefix":
            cache.trim(start)
        hi = total if mode == "prefix" else end
        with cache.attached(mode, (start, hi)):
            cached = model.run_with_hooks(x1[:, start:hi], return_type="aligned", fwd_hooks=NO_MASK,
                                          position_ids=torch.arange(start, hi)[None])
        keep = torch.zeros(total, dtype=torch.bool)
        keep[start:hi] = True
        reference = substituted(model, x1, stale, keep)[:, start:hi]
    assert cached.shape == (1, hi - start, 20)
    # the same numbers up to rounding: float64 proves the emulation exact; in fp32 the window and the full forward
    # run matmuls of other shapes (other kernels), ~1e-7 of the logits' scale apart
    tol = 1e-10 if dtype == torch.float64 else 1e-6 * float(reference.abs().max())
    torch.testing.assert_close(cached, reference, atol=tol, rtol=0)
    assert all(b.attn.kv is None for b in model.blocks)  # detached


def test_the_cache_detaches_when_a_forward_raises(model):
    cache = KVCache(model, 10)

    def boom(x, hook):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        with cache.attached("fill", (0, 10)):
            model.run_with_hooks(_canvas(0, total=10), fwd_hooks=[("blocks.1.hook_resid_post", boom)])
    assert all(b.attn.kv is None for b in model.blocks)


# --- 2. trajectories against the reference loops ---------------------------------------------------------

def _gumbel(logits, temperature):
    if temperature == 0:
        return logits
    logits = logits.to(torch.float64)
    return logits.exp() / (-torch.log(torch.rand_like(logits, dtype=torch.float64))) ** temperature


def _counts(block_masked, steps):
    n = block_masked.sum(dim=1, keepdim=True)
    out = torch.zeros(n.shape[0], steps, dtype=torch.int64) + n // steps
    for i in range(n.shape[0]):
        out[i, :int(n[i] % steps)] += 1
    return out


def _transfer(logits, temperature, remasking, mask_index, x, count, threshold, factor):
    x0 = torch.argmax(_gumbel(logits, temperature), dim=-1)
    if remasking == "low_confidence":
        x0_p = torch.gather(F.softmax(logits.to(torch.float64), dim=-1), -1, x0[..., None])[..., 0]
    else:
        x0_p = torch.rand(x0.shape)
    x0 = torch.where(mask_index, x0, x)
    conf = torch.where(mask_index, x0_p, -math.inf)
    out = torch.zeros_like(mask_index)
    for j in range(x.shape[0]):
        if factor is not None:
            n = int(mask_index[j].sum())
            th = [1 - factor / (m + 1) for m in range(1, n + 1)]
            th[0] = -1
            sc = torch.sort(conf[j][mask_index[j]], descending=True)[0]
            for top in range(len(th)):
                if sc[top] < th[top]:
                    break
            if top == 0 or top == len(th) - 1:
                top += 1
            _, sel = torch.topk(conf[j], k=top)
            out[j, sel] = True
            continue
        k = int(mask_index[j].sum()) if threshold is not None else int(count[j])
        _, sel = torch.topk(conf[j], k=k)
        out[j, sel] = True
        if threshold is not None:
            for r in range(1, k):
                if conf[j, sel[r]] < threshold:
                    out[j, sel[r]] = False
    return x0, out


def reference_cached(model, prompt, mode, steps, gen_length, block_length, temperature, remasking, threshold, factor):
    x = torch.cat([prompt, torch.full((1, gen_length), MASK)], dim=1)
    p0, total = prompt.shape[1], x.shape[1]
    spb = steps // (gen_length // block_length)
    nfe = 0
    for b in range(gen_length // block_length):
        lo, hi = p0 + b * block_length, p0 + (b + 1) * block_length
        counts = _counts(x[:, lo:hi] == MASK, spb)
        stale = fill_kv(model, x)
        logits = model.run_with_hooks(x, return_type="aligned", fwd_hooks=NO_MASK)
        mask_index = x == MASK
        mask_index[:, hi:] = False
        x0, t = _transfer(logits, temperature, remasking, mask_index, x, counts[:, 0], threshold, factor)
        x[t] = x0[t]
        nfe += 1
        i = 1
        keep = torch.zeros(total, dtype=torch.bool)
        keep[lo:(total if mode == "prefix" else hi)] = True
        while True:
            nfe += 1
            w_hi = total if mode == "prefix" else hi
            mask_index = x[:, lo:w_hi] == MASK
            mask_index[:, block_length:] = False
            logits = substituted(model, x, stale, keep)[:, lo:w_hi]
            if mode == "prefix":
                _gumbel(logits, temperature)  # drawn and unused, as there
            count = counts[:, i] if threshold is None and factor is None else None
            x0, t = _transfer(logits, temperature, remasking, mask_index, x[:, lo:w_hi], count, threshold, factor)
            x[:, lo:w_hi][t] = x0[t]
            if (x[:, lo:hi] == MASK).sum() == 0:
                break
            i += 1
    return x, nfe


CASES = [
    dict(steps=8, block_length=4, temperature=0.0, remasking="low_confidence"),
    dict(steps=12, block_length=4, temperature=0.0, remasking="low_confidence"),  # idle scheduled steps skipped
    dict(steps=4, block_length=4, temperature=0.6, remasking="low_confidence"),
    dict(steps=8, block_length=8, temperature=0.0, remasking="random"),
    dict(steps=8, block_length=4, temperature=0.0, remasking="low_confidence", threshold=0.4),
    dict(steps=8, block_length=4, temperature=0.5, remasking="low_confidence", threshold=0.0),  # idle window pass
    dict(steps=8, block_length=8, temperature=0.0, remasking="low_confidence", factor=1.5),
]


@pytest.mark.parametrize("mode", ["prefix", "dual"])
@pytest.mark.parametrize("kw", CASES)
def test_cached_trajectories_are_token_exact(model, mode, kw):
    # steps is the reference's argument; under threshold / factor generate refuses a passed steps (it is ignored)
    given = {k: v for k, v in kw.items() if k != "steps" or ("threshold" not in kw and "factor" not in kw)}
    out = model.generate(PROMPT, gen_length=8, kv_cache=mode, seed=4, fwd_hooks=NO_MASK, **given)
    torch.manual_seed(4)
    with torch.no_grad():
        ref, nfe = reference_cached(model, PROMPT.clone(), mode, kw["steps"], 8, kw["block_length"],
                                    kw["temperature"], kw["remasking"], kw.get("threshold"), kw.get("factor"))
    assert torch.equal(out.tokens, ref)
    assert out.trajectory.n_steps == nfe
    cs = out.trajectory.commit_step[0, 5:]
    assert (cs >= 0).all() and int(out.trajectory.n_committed.sum()) == 8  # every slot once


# --- 3. observability ---------------------------------------------------------------------------------------

def test_hooks_see_the_rows_each_forward_computes_and_the_cache_age(model):
    seen = []

    def spy(t, hook):
        s = model.state
        seen.append((s.step, hook.name, tuple(t.shape), s.extra["refresh"], s.extra["query_start"],
                     s.extra["kv_age"].clone()))

    hooks = [at_steps(spy, [0, 1, 2, 3], name="blocks.1.hook_resid_post"),
             at_steps(spy, [1], name="blocks.0.attn.hook_pattern")] + NO_MASK
    out = model.generate(PROMPT, gen_length=8, steps=8, block_length=4, kv_cache="dual", fwd_hooks=hooks)
    total = 13
    resid = {step: (shape, refresh, q0, age) for step, name, shape, refresh, q0, age in seen if "resid" in name}
    assert resid[0][:3] == ((1, total, 24), True, 0) and resid[0][3].tolist() == [0] * total
    assert resid[1][:3] == ((1, 4, 24), False, 5)  # the block's 4 rows
    assert resid[1][3].tolist() == [0] * 5 + [1] * 4 + [0] * 4  # block fresh, the rest from the block start
    pattern = [shape for step, name, shape, *_ in seen if "pattern" in name]
    assert pattern == [(1, 4, 4, total)]  # [batch, head, window queries, all keys]
    # prefix: the window runs from the block start to the end; keys after the prefix are fresh
    seen.clear()
    model.generate(PROMPT, gen_length=8, steps=8, block_length=4, kv_cache="prefix", fwd_hooks=hooks)
    resid = {step: (shape, age) for step, name, shape, refresh, q0, age in seen if "resid" in name}
    assert resid[1][0] == (1, 8, 24) and resid[1][1].tolist() == [0] * 5 + [1] * 8
    assert out.settings["kv_cache"] == "dual"


@pytest.mark.parametrize("kw, argument", [
    (dict(kv_cache="triple"), "kv_cache"),
    (dict(kv_cache="dual", cfg_scale=1.0), "cfg_scale"),
    (dict(kv_cache="dual", steps=2, block_length=4), "steps"),
    (dict(kv_cache="prefix", sampler_rule="eb"), "kv_cache"),
    (dict(kv_cache="prefix", logits_eos_inf=True), "logits_eos_inf"),
])
def test_inconsistent_cache_settings_are_refused_before_compute(model, kw, argument):
    calls = []
    with pytest.raises(SamplerConfigError) as info:
        model.generate(PROMPT, gen_length=8, fwd_hooks=[("hook_embed", lambda x, hook: calls.append(1))], **kw)
    assert info.value.argument == argument and calls == []


def test_a_padded_batch_is_refused_and_equal_lengths_run(model):
    two = torch.tensor([[3, 4, 5, 6, 7], [8, 9, 10, 11, 12]])
    with pytest.raises(SamplerConfigError, match="padded batch"):
        model.generate(two, attention_mask=torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]), gen_length=8,
                       steps=8, kv_cache="dual")
    batch = model.generate(two, gen_length=8, steps=8, block_length=4, kv_cache="dual", fwd_hooks=NO_MASK)
    for row in range(2):
        alone = model.generate(two[row:row + 1], gen_length=8, steps=8, block_length=4, kv_cache="dual",
                               fwd_hooks=NO_MASK)
        assert torch.equal(batch.tokens[row], alone.tokens[0])


@pytest.mark.parametrize("mode", ["prefix", "dual"])
@pytest.mark.parametrize("query", ["all", "masked", "committed"])
def test_received_attention_averages_the_window_rows_a_cached_forward_computes(model, mode, query):
    names = [f"blocks.{i}.attn.hook_pattern" for i in range(2)]
    out = model.generate(PROMPT, gen_length=8, steps=8, block_length=4, kv_cache=mode, fwd_hooks=NO_MASK,
                         record=[ReceivedAttention(query=query)], cache=TrajectoryCache(names, steps(every=1)))
    rec = out.records["received_attention"]  # [step, batch, layer, head, key]
    assert rec.shape[0] == out.trajectory.n_steps
    for step in range(out.trajectory.n_steps):
        state = out.trajectory
        x_in = state.x_steps[step]
        n_rows = out.cache[step]["pattern", 0].shape[2]  # [batch, head, window, keys]
        total = x_in.shape[1]
        block_start = 5 + 4 * int(state.block_of_step[step])
        lo = 0 if n_rows == total else (total - n_rows if mode == "prefix" else block_start)
        assert mode == "dual" or n_rows == total or lo == block_start
        rows = {"all": torch.ones(1, n_rows, dtype=torch.bool),
                "masked": (x_in == MASK)[:, lo:lo + n_rows],
                "committed": state.committed_at(step)[:, lo:lo + n_rows]}[query]
        for layer in range(2):
            p = out.cache[step]["pattern", layer].double()
            expected = torch.einsum("bhqk,bq->bhk", p, rows.double()) / rows.sum(-1).clamp(min=1)
            torch.testing.assert_close(rec[step, :, layer].double(), expected, atol=1e-6, rtol=0)


def test_nnsight_iter_reads_a_cached_step(model):
    pytest.importorskip("nnsight")
    from mdm_lens.nnsight import DiffusionLM

    lm = DiffusionLM(model)
    kw = dict(gen_length=8, steps=8, block_length=4, kv_cache="dual", fwd_hooks=NO_MASK)
    saved = []
    with lm.generate(PROMPT, **kw) as tracer:
        for _ in tracer.iter[[0, 1]]:
            saved.append(lm.blocks[1].hook_resid_post.output.save())
    ref = model.generate(PROMPT, cache="blocks.1.hook_resid_post" @ steps(0, 1), **kw)
    assert saved[0].shape == (1, 13, 24) and saved[1].shape == (1, 4, 24)  # refresh, then the block window
    for i in (0, 1):
        assert torch.equal(saved[i], ref.cache[i]["blocks.1.hook_resid_post"])


@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_cached_patterns_have_the_keys_in_position_order(model, mode):
    """The pattern a cached forward computes equals the hook-substituted forward's rows, key by key: the cached
    keys come first (positions 0..), so an anchor at key j is reported at j (a permuted key axis would leave the
    tokens unchanged but move every attention mass)."""
    x0 = _canvas(3)
    total, start, end = x0.shape[1], 7, 10
    x1 = x0.clone()
    x1[0, 7:10] = torch.tensor([2, 3, 4])
    stale = fill_kv(model, x0)
    cache = KVCache(model, total)
    got = {}
    keep_pattern = [(f"blocks.{i}.attn.hook_pattern", lambda t, hook: got.__setitem__(hook.name, t.clone()))
                    for i in range(2)]
    hi = total if mode == "prefix" else end
    with torch.no_grad():
        with cache.attached("fill", (0, total)):
            model(x0)
        if mode == "prefix":
            cache.trim(start)
        with cache.attached(mode, (start, hi)):
            model.run_with_hooks(x1[:, start:hi], position_ids=torch.arange(start, hi)[None], fwd_hooks=keep_pattern)
        cached = dict(got)
        keep = torch.zeros(total, dtype=torch.bool)
        keep[start:hi] = True
        got.clear()
        hooks = [(n, lambda t, hook: torch.where(keep[None, :, None, None], t, stale[hook.name]))
                 for n in _kv_names(model)] + keep_pattern
        model.run_with_hooks(x1, fwd_hooks=hooks)
    for name, pattern in cached.items():
        assert pattern.shape == (1, 4, hi - start, total)
        # fp32 rounding of other matmul shapes is ~1e-6; a permuted key axis moves whole masses (~1e-1)
        torch.testing.assert_close(pattern, got[name][:, :, start:hi], atol=2e-5, rtol=0)


def test_the_cache_age_a_hook_keeps_is_that_steps(model):
    """`state.extra["kv_age"]` is a snapshot: kept past its step it still says what that forward attended to."""
    kept = []

    def keep(t, hook):
        kept.append(model.state.extra["kv_age"])

    model.generate(PROMPT, gen_length=8, steps=8, block_length=4, kv_cache="prefix",
                   fwd_hooks=[at_steps(keep, [0, 1, 2], name="blocks.0.hook_resid_pre")] + NO_MASK)
    assert [a.tolist() for a in kept] == [[0] * 13, [0] * 5 + [1] * 8, [0] * 5 + [2] * 8]


def _mask_forever(x, hook):
    x = x.clone()
    x[..., MASK] = 100.0  # the model predicts the mask id everywhere
    return x


@pytest.mark.parametrize("kw", [dict(kv_cache="dual", steps=8, block_length=4),
                                dict(kv_cache="prefix", threshold=0.5, block_length=4)])
def test_a_model_that_predicts_the_mask_stops_at_the_planned_budget(model, kw):
    from mdm_lens.diffusion import plan

    planned = plan(model, gen_length=8, **kw).n_steps
    seen = []

    def count(t, hook):
        seen.append(model.state.n_steps)

    with pytest.raises(SamplerConfigError, match="mask token"):
        model.generate(PROMPT, gen_length=8, **kw, fwd_hooks=[("ln_final.hook_normalized", _mask_forever),
                                                              ("hook_embed", count)])
    assert set(seen) == {planned}
    assert len(seen) <= planned
