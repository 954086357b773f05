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


@pytest.mark.parametrize("family, prompt_len, block", [("llada2", 16, 32), ("llada2", 64, 16), ("sdar", 64, 16),
                                                       ("sdar", 16, 16)])
def test_plan_matches_the_profiled_peak_of_the_block_samplers(tmp_path: Path, family, prompt_len, block):
    """LLaDA2 forwards the block-rounded canvas and samples the block's rows; SDAR prefills the prompt's blocks
    (a long forward, a short cache), then forwards one block against a cache that grows to the canvas; both keep
    each forward's note in the trajectory. Each case leans on a different term: the rounding (16 / 32), the prefill
    (64 / 16), the trajectory and the grown cache (16 / 16)."""
    from tests.families.family_checkpoints import write_llada2, write_sdar

    folder = (write_llada2 if family == "llada2" else write_sdar)(tmp_path / family)[0]
    model = HookedMDM.from_pretrained(str(folder))
    prompt = torch.randint(0, 90, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    ratio = _ratio(model, prompt, sampler=family, steps=4, gen_length=64, block_length=block)
    assert abs(ratio - 1) <= TOL, ratio


def test_plan_matches_the_profiled_peak_of_nemotron(tmp_path: Path):
    """Nemotron's largest forward is its last causal commit over every row (the cache refilled over them), and each
    forward's canvas copy stays in the trajectory for replay."""
    from tests.families.nemotron_fixture import write_nemotron

    model = HookedMDM.from_pretrained(str(write_nemotron(tmp_path / "n")[0]))
    prompt = torch.randint(0, 90, (1, 8), generator=torch.Generator().manual_seed(0))
    ratio = _ratio(model, prompt, sampler="nemotron", gen_length=16)
    assert abs(ratio - 1) <= TOL, ratio


@pytest.mark.parametrize("family", ["mdlm", "gidd"])
def test_plan_matches_the_profiled_peak_of_the_ddit_samplers(tmp_path: Path, family):
    """The DDiT blocks' MLP is ungated (fc_in and its GELU, not gate/up/silu/product); GIDD's posterior keeps its
    own per-logit buffers (`GiddSampler.logit_bytes`)."""
    from tests.families.bd3gidd_checkpoints import write_gidd
    from tests.families.ddit_checkpoints import MDLM_CONFIG, write_ddit

    folder = (write_ddit(tmp_path / "m", dict(MDLM_CONFIG, model_length=64))[0] if family == "mdlm"
              else write_gidd(tmp_path / "g")[0])
    model = HookedMDM.from_pretrained(str(folder), load_tokenizer=False)
    prompt = torch.randint(0, 50, (2, 8 if family == "mdlm" else 4), generator=torch.Generator().manual_seed(0))
    ratio = _ratio(model, prompt, steps=8, gen_length=32 if family == "mdlm" else 8)
    assert abs(ratio - 1) <= TOL, ratio


@pytest.mark.parametrize("kv_cache", [False, True])
@pytest.mark.parametrize("width, length", [(32, 16), (128, 64)])
def test_plan_matches_the_profiled_peak_of_bd3lm(tmp_path: Path, kv_cache, width, length):
    """Without a cache the ungated MLP's fc_out output is written while fc_in's output and its GELU are held, beside
    the forward's rotary tables; with it, each layer reads the stored qkv of every key back as a copy and rotates
    its k over all keys, while the fp64 p(x0) of the finished block is still held by the storing forward. The
    trajectory keeps one canvas per sampling step of every block (blocks × steps, not `steps`). Before: 0.84 / 0.69
    at width 32, 0.83 / 0.49 at width 128."""
    from tests.families.bd3gidd_checkpoints import BD3LM_CONFIG, write_bd3lm

    folder = write_bd3lm(tmp_path / "b", dict(BD3LM_CONFIG, hidden_dim=width, model_length=length))[0]
    model = HookedMDM.from_pretrained(str(folder), load_tokenizer=False)
    prompt = torch.randint(0, 50, (1, 4), generator=torch.Generator().manual_seed(0))
    ratio = _ratio(model, prompt, steps=4, gen_length=length - 4, kv_cache=kv_cache)
    assert abs(ratio - 1) <= TOL, ratio


def test_bd3lm_trajectory_counts_every_blocks_steps(tmp_path: Path):
    """The trajectory column counts the canvases the run records: first hitting commits one position a step, so a
    block takes min(steps, its generated positions) steps; the all-prompt block none."""
    from tests.families.bd3gidd_checkpoints import write_bd3lm

    model = HookedMDM.from_pretrained(str(write_bd3lm(tmp_path / "b")[0]), load_tokenizer=False)
    plan = model.memory_plan(prompt_length=6, steps=3, gen_length=10)  # blocks of 4: 2 + 4 + 4 generated
    assert plan.rows["cpu"].caches == (2 + 3 + 3) * 16 * 8
    plan = model.memory_plan(prompt_length=6, steps=3, gen_length=10, first_hitting=False)
    assert plan.rows["cpu"].caches == 3 * 3 * 16 * 8


@pytest.mark.parametrize("family", ["rnd1", "coda"])
@pytest.mark.parametrize("prompt_len, kw", [(8, dict(gen_length=16, steps=16)),
                                            (16, dict(gen_length=48, steps=8, top_k=20, top_p=0.9))])
def test_plan_matches_the_profiled_peak_of_rnd1_and_coda(tmp_path: Path, family, prompt_len, kw):
    """Neither draws fp64 Gumbel noise (the generic per-logit figure, 1.16 / 1.31 before): RND1 scores every row
    with its own filters and log-softmax (`RND1Sampler.logit_bytes`); CoDA runs Dream's loop, which samples only
    the masked rows' copy and keeps it, beside the logits, through the next forward (`DreamSampler.carried_bytes`).
    Both peak in the feed-forward phase (RND1's MoE: every expert's output is held until they are summed)."""
    from tests.families.rnd1_coda_checkpoints import write_coda, write_rnd1

    folder = (write_rnd1 if family == "rnd1" else write_coda)(tmp_path / family)[0]
    model = HookedMDM.from_pretrained(str(folder), load_tokenizer=False)  # RND1 warns of its 30B reference defaults
    prompt = torch.randint(0, 90, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    ratio = _ratio(model, prompt, sampler=family, **kw)
    assert abs(ratio - 1) <= TOL, ratio


def test_sample_tokens_bytes_matches_its_profiled_peak():
    """Dream's `sample_tokens` per logit beside its input, by option (fp32 and bf16)."""
    from mdm_lens.diffusion.noise import sample_tokens, sample_tokens_bytes

    n, v = 64, 1000
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(n, v, generator=torch.Generator().manual_seed(0)).to(dtype)
        for kw in (dict(), dict(temperature=1.0), dict(temperature=1.0, top_k=50), dict(temperature=0.7, top_p=0.9),
                   dict(margin_confidence=True), dict(temperature=0.5, top_k=50, neg_entropy=True)):
            g = torch.Generator().manual_seed(0)
            measured = peak_live_bytes(lambda: sample_tokens(logits, generator=g, **kw)) / (n * v)
            assert abs(sample_tokens_bytes(logits.element_size(), **kw) - measured) < 0.2, (dtype, kw, measured)


def _fastdllm_v2(tmp_path: Path):
    from tests.test_fastdllm_v2 import write_fastdllm_v2

    return HookedMDM.from_pretrained(str(write_fastdllm_v2(tmp_path / "v2", bd_size=8)[0]), load_tokenizer=False)


@pytest.mark.parametrize("batch, prompt_len, kw", [
    (1, 4, dict(max_new_tokens=16, small_block_size=4, threshold=0.9)),  # no prefill, two blocks
    (1, 20, dict(max_new_tokens=32, small_block_size=4, use_block_cache=True)),  # prefill, the block's own cache
    (2, 12, dict(max_new_tokens=16, small_block_size=8)),  # a batch, a prefill that ends mid-block
    (1, 9, dict(max_new_tokens=32, small_block_size=8, temperature=0.7, top_p=0.9)),  # the nucleus draw
])
def test_plan_matches_the_profiled_peak_of_fastdllm_v2(tmp_path: Path, batch, prompt_len, kw):
    """Fast-dLLM v2 always keeps an exact KV cache of the finished blocks (its kv_cache column, 0 before); each
    forward concatenates a layer's cache with its rows' keys / values, holds the previous forward's raw logits
    and their shifted copy, samples one sub-block, and notes its canvas for replay (once per masked position and
    AR step: the bound is reached when no stop token is drawn). Not measured before."""
    model = _fastdllm_v2(tmp_path)
    prompt = torch.randint(0, 90, (batch, prompt_len), generator=torch.Generator().manual_seed(0))
    kw = dict(sampler="fastdllm_v2", block_size=8, stop_token=95, pad_id=2, **kw)
    plan = model.memory_plan(prompt, **kw).rows["cpu"]
    assert plan.kv_cache > 0
    ratio = _ratio(model, prompt, **kw)
    assert abs(ratio - 1) <= TOL, ratio


def test_fastdllm_v2_releases_the_prefill_logits(tmp_path: Path):
    """The prompt's logits `[batch, whole prompt blocks, vocab]` were held by the loop through every later forward
    (only their last row is read); released once the AR token is read."""
    import weakref

    model = _fastdllm_v2(tmp_path)
    outputs, alive = [], []

    def hook(module, args, out):
        if outputs:
            alive.append(outputs[0]() is not None)
        outputs.append(weakref.ref(out))

    handle = model.register_forward_hook(hook)
    try:
        model.generate(torch.randint(0, 90, (1, 20), generator=torch.Generator().manual_seed(0)),
                       sampler="fastdllm_v2", block_size=8, max_new_tokens=8, stop_token=95, pad_id=2)
    finally:
        handle.remove()
    assert len(alive) >= 2 and not any(alive), alive
