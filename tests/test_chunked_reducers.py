"""Query-chunked pattern statistics (mdm_lens/pattern_rows.py): the same numbers as the full-pattern
path, for every reducer, mask kind and chunk size, without ever holding a [batch, head, T, T] pattern."""

from __future__ import annotations

import pytest
import torch

from mdm_lens import HookedMDM, MDMConfig, ReceivedAttention, TopKKeys, masks
from mdm_lens.errors import ArgumentError, OutOfRangeError
from mdm_lens.hooks.reducers import received_by_layer
from mdm_lens.pattern_rows import ColumnSums, PatternRows, RowConsumer, RowTopK, chunk_rows, row_hook, set_query_chunk
from mdm_lens.probes import floating
from mdm_lens.probes import run as R

MASK = 49


def tiny(attention="bidirectional", n_kv=2, padding="key", logit_shift=False, seed=1, n_ctx=64):
    cfg = MDMConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=n_kv, d_mlp=48, d_vocab=50, attention=attention,
                    qkv_bias=True, mask_token_id=MASK, padding_mask=padding, logit_shift=logit_shift, n_ctx=n_ctx,
                    eos_token_id=1)
    return HookedMDM.from_config(cfg, seed=seed, init_std=0.3)


def set_full(model, on):
    for block in model.blocks:
        block.attn.force_explicit = on


def tokens_and_mask(T, pad):
    g = torch.Generator().manual_seed(T)
    t = torch.randint(2, 40, (3, T), generator=g)
    am = torch.ones_like(t)
    if pad and T > 3:
        am[1, :3] = 0  # left padding of one row
    return t, am


def forward_stats(model, t, am, attn_mask, k, extra=()):
    """(column sums [layer, b, h, key], top-k values, top-k indices, logits) of one forward, via row consumers."""
    rows = am.bool()
    sums = [ColumnSums(lambda _: rows, kind="cumulative") for _ in range(2)]
    tops = [RowTopK(k) for _ in range(2)]
    hooks = [row_hook(model, l, c) for l in range(2) for c in (sums[l], tops[l])]
    logits = model.run_with_hooks(t, attention_mask=am, attn_mask=attn_mask, fwd_hooks=list(extra) + hooks)
    return (torch.stack([s.result for s in sums]), torch.stack([x.values for x in tops]),
            torch.stack([x.indices for x in tops]), logits)


def planted_order(layer, T, seed=0):
    """Hooks making layer's score q·k/√e = 0.7·perm[key] for every query: a known, well-separated order."""
    perm = torch.randperm(T, generator=torch.Generator().manual_seed(seed)).float()

    def q_hook(q, hook):
        q = torch.zeros_like(q)
        q[..., 0] = 4.0
        return q

    def k_hook(k, hook):
        k = torch.zeros_like(k)
        k[..., 0] = perm[None, :, None] * 0.7 * k.shape[-1] ** 0.5 / 4.0
        return k
    return [(f"blocks.{layer}.attn.hook_rot_q", q_hook), (f"blocks.{layer}.attn.hook_rot_k", k_hook)], perm


@pytest.mark.parametrize("attention,n_kv,padding,explicit", [
    ("bidirectional", 4, None, False), ("bidirectional", 2, "key", False), ("bidirectional", 1, "pair", False),
    ("causal", 2, None, False), ("causal", 4, "key", False), ("bidirectional", 2, "key", True),
    ("causal", 1, "pair", True)])
def test_chunked_rows_equal_the_full_pattern_for_every_mask(attention, n_kv, padding, explicit):
    model = tiny(attention, n_kv, padding or "key")
    T, k = 11, 3
    t, am = tokens_and_mask(T, padding is not None)
    attn_mask = masks.block_causal(T, block_length=3, prefix=5) if explicit else None
    plant, perm = planted_order(1, T)
    with model.hooks(fwd_hooks=plant):
        _, cache = model.run_with_cache(t, attention_mask=am, attn_mask=attn_mask,
                                        names_filter=lambda n: n.endswith("hook_pattern"))
    full = torch.stack([cache[f"blocks.{l}.attn.hook_pattern"] for l in range(2)])  # [layer, b, h, q, k]
    ref_sums = (full * am.bool()[None, :, None, :, None]).sum(-2)
    ref_vals, ref_idx = full.topk(k, dim=-1)
    # planted layer 1: rows that see more than k keys rank them by perm, k-th and (k+1)-th clearly apart
    ranked = (full[1] > 0).sum(-1) > k
    assert ranked.sum() > 10
    top = full[1].topk(k + 1, dim=-1).values
    assert (top[..., k - 1] / top[..., k].clamp(min=1e-30))[ranked].min() > 1.5
    for size in (1, 3, 4, T, None):  # 3 and 4 do not divide 11
        set_query_chunk(model, size)
        sums, vals, idx, logits = forward_stats(model, t, am, attn_mask, k, extra=plant)
        torch.testing.assert_close(sums, ref_sums, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(vals, ref_vals, atol=1e-6, rtol=1e-6)
        assert torch.equal(idx[1][ranked], ref_idx[1][ranked])
        visible_perm = torch.where(full[1][ranked] > 0, perm, torch.full_like(perm, -1.0))
        assert torch.equal(idx[1][ranked], visible_perm.topk(k, dim=-1).indices)  # the planted order itself
    valid = am.bool()
    plain = model.run_with_hooks(t, attention_mask=am, attn_mask=attn_mask, fwd_hooks=plant)
    # the chunked layer output is the same model, to fp32 rounding of the logits' scale
    assert (logits - plain)[valid].abs().max() <= 1e-5 * max(1.0, float(plain[valid].abs().max()))


def test_one_position_and_sdpa_row_mode():
    model = tiny()
    t = torch.tensor([[7]])
    sums, vals, idx, _ = forward_stats(model, t, torch.ones_like(t), None, 4)
    assert sums.shape == (2, 1, 4, 1) and torch.equal(sums, torch.ones(2, 1, 4, 1))
    assert torch.equal(idx, torch.zeros(2, 1, 4, 1, 1, dtype=torch.long))
    t, am = tokens_and_mask(9, True)
    set_query_chunk(model, 2)
    a = forward_stats(model, t, am, None, 2)
    set_query_chunk(model, 2, row_mode="sdpa")
    b = forward_stats(model, t, am, None, 2)
    assert torch.equal(a[0][0], b[0][0]) and torch.equal(a[2][0], b[2][0])  # layer 0: the same rows
    torch.testing.assert_close(a[0][1], b[0][1], atol=1e-5, rtol=1e-5)  # layer 1 reads SDPA's (equivalent) z
    assert (a[3] - b[3])[am.bool()].abs().max() <= 1e-5


SAMPLERS = [("llada", "bidirectional", False), ("arm", "causal", False), ("dream", "bidirectional", True)]


@pytest.mark.parametrize("sampler,attention,shift", SAMPLERS)
def test_reducers_in_a_sampler_equal_the_full_path(sampler, attention, shift):
    model = tiny(attention, padding="pair" if sampler == "dream" else "key", logit_shift=shift)
    prompt, am = tokens_and_mask(6, True)
    # an ARM run refuses "masked" / "committed": its steps have no masked rows and commit a position after them
    queries = ["all", "prompt", "generated"] + ([] if sampler == "arm" else ["committed", "masked"])

    def record():
        return [ReceivedAttention(query=q, kind=kind, name=f"{q}-{kind}") for q in queries
                for kind in ("mass", "cumulative")] + [TopKKeys(k=2)]

    kw = dict(steps=4, gen_length=4, attention_mask=am, record=record())
    set_full(model, True)
    full = model.generate(prompt, **kw)
    set_full(model, False)
    set_query_chunk(model, 3)
    calls = []
    orig = type(model.blocks[0].attn)._chunked
    type(model.blocks[0].attn)._chunked = lambda self, *a: calls.append(1) or orig(self, *a)
    try:
        kw["record"] = record()
        chunked = model.generate(prompt, **kw)
    finally:
        type(model.blocks[0].attn)._chunked = orig
    assert len(calls) == 2 * 4  # every layer at every step took the chunked path
    assert torch.equal(chunked.tokens, full.tokens)
    for name, ref in full.records.items():
        if name == "topk_keys":
            keep = full.records["topk_attention"][..., -1] > 0  # rows of real queries (ties only at zero)
            assert torch.equal(chunked.records[name][keep], ref[keep])
        else:
            # the chunked path reads layer 1 from SDPA-equivalent rows: fp32 agreement as the two attention paths
            # (≤1e-5 of the record's scale; realistic norm weights give 1.5e-6 on a 0.5 mass), not bit identity
            scale = max(1.0, float(ref.nan_to_num().abs().max()))
            torch.testing.assert_close(chunked.records[name], ref, atol=1e-5 * scale, rtol=1e-5, equal_nan=True,
                                       msg=lambda m, name=name: f"{name}: {m}")


def test_committed_rows_match_the_cached_pattern():
    model = tiny()
    prompt, _ = tokens_and_mask(5, False)
    out = model.generate(prompt, steps=4, gen_length=8, record=[ReceivedAttention(query="committed", kind="cumulative")],
                         cache="blocks.1.attn.hook_pattern")  # layer 1 full, layer 0 chunked
    plain = model.generate(prompt, steps=4, gen_length=8, record=[ReceivedAttention(query="committed",
                                                                                     kind="cumulative")])
    torch.testing.assert_close(plain.records["received_attention"], out.records["received_attention"],
                               atol=1e-6, rtol=1e-6)
    for s in range(4):
        rows = out.trajectory.committed_at(s)
        assert int(rows.sum()) == 3 * 2  # 8 tokens over 4 steps: 2 per row, 3 rows
        expected = (out.cache[s]["blocks.1.attn.hook_pattern"] * rows[:, None, :, None]).sum(2)
        torch.testing.assert_close(plain.records["received_attention"][s, :, 1], expected, atol=1e-6, rtol=1e-6)


class Shapes(RowConsumer):
    def start(self, rows):
        self.shapes, self.starts = [], []

    def consume(self, pattern, start):
        self.shapes.append(tuple(pattern.shape))
        self.starts.append(start)


def largest_allocation(prof) -> int:
    """The largest block any one op allocated itself (torch's CPU allocator, seen by the profiler)."""
    return max(e.self_cpu_memory_usage for e in prof.events())


def test_the_full_pattern_is_never_materialised():
    model = tiny(n_kv=2, n_ctx=128)
    b, T, chunk = 1, 128, 8
    t = torch.randint(2, 40, (b, T))
    set_query_chunk(model, chunk)
    seen = Shapes()
    hooked = []
    watch = ("blocks.0.attn.hook_z", lambda z, hook: hooked.append(model.blocks[0].attn.hook_pattern.has_hooks()))
    hooks = [row_hook(model, 0, seen), row_hook(model, 0, ColumnSums(lambda _: torch.ones(b, T, dtype=torch.bool))),
             row_hook(model, 1, RowTopK(2)), watch]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        model.run_with_hooks(t, fwd_hooks=hooks)
    assert hooked == [False]
    assert seen.shapes == [(b, 4, chunk, T)] * (T // chunk) and seen.starts == list(range(0, T, chunk))
    biggest = largest_allocation(prof)
    full_bytes = b * 4 * T * T * 4
    # the largest single allocation is the MLP's [b, T, 2·d_mlp] (48 KiB); a chunk is b·h·chunk·T·4 = 16 KiB
    assert biggest < full_bytes / 4
    # the same forward with a hook on the pattern does allocate it (the measure can see it)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        model.run_with_hooks(t, fwd_hooks=hooks + [("blocks.0.attn.hook_pattern", lambda p, hook: None)])
    assert largest_allocation(prof) >= full_bytes


def test_tl_hooks_on_scores_still_see_and_edit_the_full_pattern():
    model = tiny()
    t, am = tokens_and_mask(9, False)
    set_query_chunk(model, 2)

    def knock(scores, hook):  # hide key 4 from every query: the consumers must see the edited pattern
        scores[..., 4] = float("-inf")
        return scores

    sums = ColumnSums(lambda _: am.bool(), kind="mass")
    model.run_with_hooks(t, fwd_hooks=[("blocks.1.attn.hook_attn_scores", knock), row_hook(model, 1, sums)])
    assert (sums.result[..., 4] == 0).all()
    torch.testing.assert_close(sums.result.sum(-1), torch.ones(3, 4), atol=1e-6, rtol=1e-6)


def test_consumers_are_removed_even_when_the_run_raises():
    model = tiny()
    t, _ = tokens_and_mask(5, False)
    c = Shapes()

    def boom(x, hook):
        raise ValueError("boom")

    with pytest.raises(ValueError):
        model.run_with_hooks(t, fwd_hooks=[row_hook(model, 0, c), ("blocks.0.attn.hook_z", boom)])
    assert all(not b.attn._row_consumers for b in model.blocks)
    c.shapes = []
    model(t)
    assert c.shapes == []  # not fed again


def test_received_by_layer_is_what_absorption_reduces():
    for attention in ("bidirectional", "causal"):
        model = tiny(attention, padding="pair" if attention == "causal" else "key")
        set_query_chunk(model, 4)
        t, am = tokens_and_mask(10, True)
        A = R.final_attention(model, t, am).to(torch.float64)  # [b, layer, head, q, k]
        kv = am.bool()[:, None, None, :]
        for kind in ("mass", "cumulative", "visibility"):
            expected = floating.received_attention(A, key_visible=kv, kind=kind, causal=attention == "causal")
            torch.testing.assert_close(received_by_layer(model, t, am, kind=kind), expected, atol=1e-6, rtol=1e-6)
        qm = t > 20
        expected = floating.received_attention(A, query_mask=qm[:, None, None, :], key_visible=kv,
                                               causal=attention == "causal")
        torch.testing.assert_close(received_by_layer(model, t, am, query_mask=qm), expected, atol=1e-6, rtol=1e-6)
        # absorption from the chunked statistic = absorption_by_layer on the full patterns
        res = R.absorption_by_layer(model, t, attention_mask=am)
        kvb = floating.align_mask(am.bool(), 3, batch_dim=0)
        ours = floating.absorption_variants(received_by_layer(model, t, am).mean(2), kvb,
                                            causal=attention == "causal")
        torch.testing.assert_close(torch.stack([ours.pos0, ours.top1, ours.anchors], -1), res.per_sample,
                                   atol=1e-6, rtol=1e-6)


def test_arguments_are_checked():
    model = tiny()
    with pytest.raises(OutOfRangeError):
        row_hook(model, 2, Shapes())
    with pytest.raises(ArgumentError):
        row_hook(model, 0, lambda p, s: None)
    with pytest.raises(ArgumentError):
        set_query_chunk(model, 0)
    with pytest.raises(ArgumentError):
        set_query_chunk(model, 4, row_mode="flash")
    with pytest.raises(ArgumentError):
        received_by_layer(model, torch.ones(1, 3, dtype=torch.long), kind="max")
    with pytest.raises(ArgumentError):
        RowTopK(0)
    assert chunk_rows(1, 8, 8192, 8192, budget_bytes=8 * 8192 * 4 * 100) == 100
    assert chunk_rows(1, 8, 50, 8192, budget_bytes=2**40) == 50 and chunk_rows(4, 8, 50, 50, budget_bytes=1) == 1


def test_pattern_rows_select_equals_rows():
    q, k = torch.randn(2, 4, 7, 8), torch.randn(2, 2, 7, 8)
    mask = torch.rand(2, 1, 7, 7) > 0.3
    mask[..., 0] = True
    for m, causal in ((mask, False), (None, True), (None, False)):
        rows = PatternRows(q, k, m, causal, torch.float32)
        whole = rows.rows(0, 7)
        torch.testing.assert_close(whole.sum(-1), torch.ones(2, 4, 7))
        torch.testing.assert_close(rows.select(torch.tensor([5, 1])), whole[:, :, [5, 1]], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(torch.cat([c for _, c in rows.chunks(3)], 2), whole, atol=1e-6, rtol=1e-6)
        if causal:
            assert (whole.triu(1) == 0).all()


def test_benchmark_runs_at_a_smoke_size(tmp_path):
    from benchmarks import bench_chunked

    out = tmp_path / "chunked.md"
    bench_chunked.main(["--seqs", "24,40", "--chunk", "16", "--repeats", "1", "--threads", "1", "--inline",
                        "--out", str(out)])
    lines = [l for l in out.read_text().splitlines() if l.startswith("| 24 ") or l.startswith("| 40 ")]
    assert [l.split("|")[2].strip() for l in lines] == ["full", "chunk=16", "chunk=16 sdpa", "auto"] * 2
    assert lines[5].split("|")[3].strip() == "16"  # T=40, chunk=16: 16-row chunks
    for l in lines:
        assert float(l.split("|")[10]) <= 1e-6  # the statistic equals the full path's
