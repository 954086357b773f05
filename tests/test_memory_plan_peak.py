"""`model.memory_plan(...)`'s run part (activations + KV caches + requested caches) against torch.profiler's peak of
live CPU tensor bytes during the same `generate` call. Memory counts are deterministic (the allocator's exact
tensor allocations, not RSS and not time), so a tolerance on them is a real check."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from mdm_lens import HookedMDM, ReceivedAttention

TOL = 0.10


def peak_live_bytes(fn) -> int:
    """The largest sum of live tensor bytes over the allocation/free records of `fn`'s run (ordered by time)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    records = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]")
    live = peak = 0
    for _, n in records:
        live += n
        peak = max(peak, live)
    return peak


def _ratio(model, prompt, **kw) -> float:
    plan = model.memory_plan(prompt, **kw).rows["cpu"]
    with torch.no_grad():
        measured = peak_live_bytes(lambda: model.generate(prompt, **kw))
    assert measured > 0
    return (plan.total - plan.weights) / measured


@pytest.fixture(scope="module")
def tiny():
    return HookedMDM.from_pretrained("mdm-lens/tiny-mdm")


@pytest.mark.parametrize("batch,prompt_len,gen,kw", [
    (1, 32, 32, dict(kv_cache="dual", record=[ReceivedAttention()])),  # Fast-dLLM dual cache, chunked rows
    (4, 16, 48, dict()),  # LLaDA's plain loop, SDPA
])
def test_plan_matches_the_profiled_peak_of_the_trained_twin(tiny, batch, prompt_len, gen, kw):
    prompt = torch.randint(5, 300, (batch, prompt_len), generator=torch.Generator().manual_seed(batch))
    ratio = _ratio(tiny, prompt, steps=4, gen_length=gen, block_length=gen, **kw)
    assert abs(ratio - 1) <= TOL, ratio


def test_plan_matches_the_profiled_peak_of_an_moe_family(tmp_path: Path):
    from tests.families.family_checkpoints import write_lladamoe

    folder, _, _ = write_lladamoe(tmp_path / "lladamoe")
    model = HookedMDM.from_pretrained(str(folder))
    assert model.cfg.extra["moe"]["score"] == "softmax" and any(model.cfg.extra["moe_layers"])
    prompt = torch.randint(0, 90, (4, 64), generator=torch.Generator().manual_seed(0))
    ratio = _ratio(model, prompt, steps=4, gen_length=64)
    assert abs(ratio - 1) <= TOL, ratio


def test_the_plan_follows_the_attention_path_the_run_takes():
    """Reducers reading pattern rows make the forward run chunked attention (three `[batch, head, chunk, key]` fp32
    buffers per chunk), a cached `hook_pattern` the explicit full pattern, neither SDPA. On a long canvas of a narrow
    model the attention phase is the peak, so the plan must grow in that order."""
    from mdm_lens import MDMConfig
    from mdm_lens.hooks.plan import _attention_path

    model = HookedMDM.from_config(MDMConfig(d_model=32, n_layers=2, n_heads=4, d_mlp=48, d_vocab=50, n_ctx=1024,
                                            mask_token_id=49), seed=0, init="realistic")
    assert _attention_path(model, None, []) == "sdpa"
    assert _attention_path(model, None, [ReceivedAttention()]) == "chunked"
    assert _attention_path(model, "blocks.0.attn.hook_pattern", []) == "explicit"
    prompt = torch.zeros(1, 88, dtype=torch.long)
    act = lambda **kw: model.memory_plan(prompt, gen_length=512, steps=2, **kw).rows["cpu"].activations  # noqa: E731
    plain, chunked = act(), act(record=[ReceivedAttention()])
    explicit = act(cache="blocks.0.attn.hook_pattern")
    assert plain < chunked < explicit


def test_attention_phase_counts_k_and_v_only_without_a_kv_cache():
    """Without a cache the block's k and v are its own tensors; with one they are the cache's (its own column)."""
    from mdm_lens import MDMConfig
    from mdm_lens.hooks.forward_bytes import attention_phase_bytes

    cfg = MDMConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_head=8, d_mlp=48, d_vocab=50,
                    n_ctx=256, mask_token_id=49)
    for path in ("sdpa", "chunked", "explicit"):
        own = attention_phase_bytes(cfg, 3, 40, 4, path, kv_cache=False)
        cached = attention_phase_bytes(cfg, 3, 40, 4, path, kv_cache=True)
        assert own - cached == 2 * 3 * 40 * 2 * 8 * 4, path  # k and v: [batch, pos, kv_heads * d_head] fp32
