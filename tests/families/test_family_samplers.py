"""The block-diffusion samplers (`sampler="llada2"`, `sampler="sdar"`) are token-exact against transcriptions of
their reference loops written here (LLaDA2MoeModelLM.generate of ZHZisZZ/dllm @ ca176752; JetAstra/SDAR
`block_diffusion_generate`), same seed, on the tiny family checkpoints.

The transcriptions' "model" is the HookedMDM forward over the canvas prefix with the block-causal mask (no KV
cache): for LLaDA2 that is what the reference runs, except that its additive block mask is cast to bf16 — here the
comparison is in fp32 with that cast left out (a 0/-inf mask is exact in either dtype; the cast only matters for
the bf16 attention). For SDAR the sampler's exact block KV cache is thus checked against full forwards.
EOS / stop tokens are planted by naming as EOS a token these weights emit often."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from family_checkpoints import write_llada2, write_lladamoe, write_sdar

from mdm_lens import HookedMDM
from mdm_lens.diffusion.generate import default_sampler, generate, plan
from mdm_lens.errors import InputError, SamplerConfigError
from mdm_lens.hooks.reducers import KeyValueNorms, ReceivedAttention
from mdm_lens.hooks.steps import at_steps, steps


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("bd_samplers")
    # near_one: the planted EOS tokens and LLaDA2 scenarios below were picked from these weights' outputs; the
    # forward itself is checked on realistic weights in test_family_forward.py
    return {"llada2": HookedMDM.from_pretrained(write_llada2(root / "llada2", init="near_one")[0]),
            "sdar": HookedMDM.from_pretrained(write_sdar(root / "sdar")[0]),
            "lladamoe": HookedMDM.from_pretrained(write_lladamoe(root / "lladamoe")[0])}


def _prompt(n: int) -> torch.Tensor:
    return torch.randint(0, 90, (1, n), generator=torch.Generator().manual_seed(n))


# ---- shared reference pieces ------------------------------------------------------------------------------------
def ref_filter(logits, top_k, top_p):
    if top_k is not None and top_k > 0:
        values, _ = torch.topk(logits, top_k)
        logits = torch.where(logits < values[..., -1, None], torch.full_like(logits, float("-inf")), logits)
    if top_p is not None and top_p < 1.0:
        sorted_logits, sorted_indices = torch.sort(logits, descending=True)
        cumulative = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1)
        sorted_mask = cumulative > top_p
        sorted_mask[..., 1:] = sorted_mask[..., :-1].clone()
        sorted_mask[..., 0] = False
        mask = torch.scatter(torch.full_like(logits, False, dtype=torch.bool), -1, sorted_indices, sorted_mask)
        logits = logits.masked_fill(mask, float("-inf"))
    return logits


def ref_sample(logits, temperature, top_k, top_p, gen):
    shape = logits.shape[:-1]
    logits = logits.reshape(-1, logits.shape[-1])
    if temperature == 0.0:
        probs = F.softmax(logits, dim=-1)
        token = torch.argmax(probs, dim=-1, keepdim=True)
        return token.view(*shape), torch.gather(probs, -1, token).view(*shape)
    if temperature != 1.0:
        logits = logits / temperature
    probs = F.softmax(ref_filter(logits, top_k, top_p), dim=-1)
    token = torch.multinomial(probs, num_samples=1, generator=gen)
    return token.view(*shape), torch.gather(probs, -1, token).view(*shape)


def ref_schedule(block_length, steps):
    out = torch.zeros(steps, dtype=torch.int64) + block_length // steps
    out[:block_length % steps] += 1
    return out


# ---- LLaDA2 -----------------------------------------------------------------------------------------------------
def ref_llada2(model, prompt, *, gen_length, block_length, steps, temperature=0.0, top_p=None, top_k=None,
               eos_early_stop=False, minimal_topk=1, threshold=0.95, eos_id, mask_id=100, seed=0):
    """(canvas, returned span) of LLaDA2MoeModelLM.generate."""
    gen = torch.Generator().manual_seed(seed)
    steps = min(steps, gen_length // minimal_topk)
    prompt_length = prompt.shape[1]
    num_blocks = (prompt_length + gen_length + block_length - 1) // block_length
    total_length = num_blocks * block_length
    position_ids = torch.arange(total_length).unsqueeze(0)
    x = torch.full((1, total_length), mask_id, dtype=torch.long)
    x[:, :prompt_length] = prompt.clone()
    schedule = ref_schedule(block_length, steps)
    for num_block in range(prompt_length // block_length, num_blocks):
        end = (num_block + 1) * block_length
        cur_x = x[:, :end]
        for step in range(steps):
            active = cur_x[:, -block_length:] == mask_id
            if active.sum() == 0:
                break
            logits = model(cur_x, position_ids=position_ids[:, :end], block_length=block_length)
            x0, x0_p = ref_sample(logits[:, -block_length:, :], temperature, top_k, top_p, gen)
            num = schedule[step].item()
            transfer = torch.zeros_like(x0, dtype=torch.bool)
            confidence = torch.where(active, x0_p, -torch.inf)
            high = confidence[0] > threshold
            if high.sum().item() >= num:
                transfer[0] = high
            else:
                _, idx = torch.topk(confidence[0], k=min(num, active.sum().item()))
                transfer[0, idx] = True
            if transfer.any():
                cur_x[:, -block_length:][transfer] = x0[transfer]
            if eos_early_stop and (x0[transfer] == eos_id).any():
                eos_pos = (cur_x[0] == eos_id).nonzero(as_tuple=True)[0][0].item()
                if (cur_x[0, prompt_length:eos_pos] != mask_id).all():
                    return x, x[:, prompt_length:eos_pos + 1]
        x[:, :end] = cur_x
        if eos_id is not None and (x[0, prompt_length:end] == eos_id).any():
            break
    answer = x[:, :prompt_length + gen_length]
    eos_positions = (answer[0][prompt_length:] == eos_id).nonzero(as_tuple=True)[0]
    first = eos_positions[0].item() if len(eos_positions) > 0 else gen_length
    return x, answer[:, prompt_length:prompt_length + first + 1]


LLADA2_CASES = [
    dict(prompt=6, gen_length=12, block_length=4, steps=4),
    dict(prompt=8, gen_length=8, block_length=4, steps=2, threshold=0.0),  # every mask passes: one step per block
    dict(prompt=5, gen_length=10, block_length=4, steps=3, threshold=0.05),
    dict(prompt=6, gen_length=12, block_length=4, steps=4, temperature=0.8, top_k=6, top_p=0.9),
    dict(prompt=3, gen_length=9, block_length=8, steps=8, temperature=1.0, minimal_topk=3),  # steps -> 3
    dict(prompt=6, gen_length=12, block_length=4, steps=4, eos=18),  # planted EOS: stops after the block
    dict(prompt=6, gen_length=12, block_length=4, steps=4, eos=18, eos_early_stop=True),
    dict(prompt=6, gen_length=16, block_length=4, steps=4, eos=96, temperature=0.7, eos_early_stop=True),
]


@pytest.mark.parametrize("case", LLADA2_CASES)
def test_llada2_matches_reference(models, monkeypatch, case):
    model = models["llada2"]
    case = dict(case)
    prompt, eos = _prompt(case.pop("prompt")), case.pop("eos", 98)
    monkeypatch.setattr(model.cfg, "eos_token_id", eos)
    with torch.no_grad():
        canvas, span = ref_llada2(model, prompt, eos_id=eos, **case)
    out = generate(model, prompt, sampler="llada2", **case)
    n = prompt.shape[1] + case["gen_length"]
    assert torch.equal(out.tokens, canvas[:, :n])
    assert out.answer_length == [min(span.shape[1], case["gen_length"])]
    assert out.trajectory.x_steps.shape[2] == n and out.tokens.shape == (1, n)
    if eos != 98:  # the planted EOS was generated and ends the answer
        assert int(out.tokens[0, prompt.shape[1] + out.answer_length[0] - 1]) == eos


def test_llada2_eos_stops_decoding(models, monkeypatch):
    """The planted EOS lands in the first block: later blocks are never decoded (mask ids remain)."""
    model = models["llada2"]
    monkeypatch.setattr(model.cfg, "eos_token_id", 18)
    out = generate(model, _prompt(6), sampler="llada2", gen_length=12, block_length=4, steps=4)
    gen = out.generated[0]
    assert bool((gen[:2] == 18).any()) and bool((gen[2:] == 100).all())
    assert out.answer_length[0] == int((gen == 18).nonzero()[0, 0]) + 1
    assert out.trajectory.n_steps == 2 and set(out.trajectory.block_of_step.tolist()) == {0}


def test_llada2_eos_early_stop_ends_mid_block(models, monkeypatch):
    """eos_early_stop returns as soon as the EOS is committed with everything before it decoded: the rest of
    that block stays masked, where without it the block is finished first."""
    model = models["llada2"]
    monkeypatch.setattr(model.cfg, "eos_token_id", 96)
    kw = dict(gen_length=16, block_length=4, steps=4, temperature=0.7)
    early = generate(model, _prompt(6), sampler="llada2", eos_early_stop=True, **kw)
    late = generate(model, _prompt(6), sampler="llada2", **kw)
    assert early.answer_length == late.answer_length == [3] and int(early.generated[0, 2]) == 96
    assert int((early.generated[0, :6] == 100).sum()) > 0 and not bool((late.generated[0, :6] == 100).any())
    assert bool((late.generated[0, 6:] == 100).all()) and early.trajectory.n_steps < late.trajectory.n_steps


def test_llada2_invariants_and_observation(models):
    """Without EOS every generated slot is committed exactly once; each forward covers the canvas up to the active
    block's end; steps(blocks=[1]) fires only on block 1's forwards."""
    model = models["llada2"]
    seen = []

    def spy(t, hook):
        st = model.state
        seen.append((st.step, st.block, t.shape[1], st.extra["query_end"], st.block_slice.stop))

    out = generate(model, _prompt(6), sampler="llada2", gen_length=12, block_length=4, steps=4, threshold=1.0,
                   fwd_hooks=[at_steps(spy, steps(blocks=[1]), name="hook_embed")],
                   record=[KeyValueNorms()])
    tr = out.trajectory
    gen = tr.commit_step[0, 6:]
    assert bool((gen >= 0).all()) and int(tr.n_committed.sum()) == 12  # threshold 1: one per step, once each
    assert out.answer_length == [12] and not bool((out.tokens == 100).any())
    assert seen and all(b == 1 and rows == qe == stop for _, b, rows, qe, stop in seen)
    assert [s for s, *_ in seen] == [i for i, b in enumerate(tr.block_of_step.tolist()) if b == 1]


def ref_llada21(model, prompt, *, gen_length, block_length, temperature=0.0, top_p=None, top_k=None,
                eos_early_stop=False, threshold=0.95, editing_threshold=0.9, max_post_steps=16, num_to_transfer=1,
                eos_id, mask_id=100, seed=0):
    """(canvas, returned span) of LLaDA2.1's generate (modeling_llada21_moe.py @ ca176752)."""
    gen = torch.Generator().manual_seed(seed)
    prompt_length = prompt.shape[1]
    num_blocks = (prompt_length + gen_length + block_length - 1) // block_length
    total_length = num_blocks * block_length
    position_ids = torch.arange(total_length).unsqueeze(0)
    x = torch.full((1, total_length), mask_id, dtype=torch.long)
    x[:, :prompt_length] = prompt.clone()
    for num_block in range(prompt_length // block_length, num_blocks):
        end = (num_block + 1) * block_length
        cur_x = x[:, :end]
        block_start = num_block * block_length
        post_steps = 0
        while True:
            old = cur_x[:, -block_length:].clone()
            active = cur_x[:, -block_length:] == mask_id
            if not torch.any(active):
                post_steps += 1
            if post_steps > max_post_steps:
                break
            prompt_in_block = torch.zeros(block_length, dtype=torch.bool)
            if block_start < prompt_length:
                prompt_in_block[:min(prompt_length - block_start, block_length)] = True
            logits = model(cur_x, position_ids=position_ids[:, :end], block_length=block_length)
            x0, x0_p = ref_sample(logits[:, -block_length:, :], temperature, top_k, top_p, gen)
            fill = torch.zeros_like(x0, dtype=torch.bool)
            if active.sum() > 0:
                conf = torch.where(active, x0_p, -torch.inf)
                high = (conf[0] > threshold) & active[0]
                if high.sum().item() >= num_to_transfer:
                    fill[0] = high
                else:
                    _, idx = torch.topk(conf[0], k=min(num_to_transfer, active.sum().item()))
                    fill[0, idx] = True
            edit = torch.zeros_like(x0, dtype=torch.bool)
            editable = ~active & ~prompt_in_block[None, :]
            edit_conf = torch.where(editable, x0_p, -torch.inf)
            edit[0] = (edit_conf[0] > editing_threshold) & editable[0] & (x0[0] != old[0])
            chosen = fill | edit
            if chosen.any():
                cur_x[:, -block_length:][chosen] = x0[chosen]
            if active.sum() == 0 and not edit.any():
                break
        x[:, :end] = cur_x
        if eos_early_stop:
            part = x[0, prompt_length:end]
            if (part == mask_id).sum() == 0 and len((part == eos_id).nonzero(as_tuple=True)[0]) > 0:
                break
    answer = x[:, :prompt_length + gen_length]
    eos_positions = (answer[0][prompt_length:] == eos_id).nonzero(as_tuple=True)[0]
    first = eos_positions[0].item() if len(eos_positions) > 0 else gen_length
    return x, answer[:, prompt_length:prompt_length + first + 1]


LLADA21_CASES = [
    dict(prompt=6, gen_length=12, block_length=4, editing_threshold=0.9),
    dict(prompt=6, gen_length=12, block_length=4, editing_threshold=0.0, max_post_steps=3),
    dict(prompt=5, gen_length=10, block_length=4, editing_threshold=0.02, temperature=0.9, threshold=0.03,
         num_to_transfer=2, max_post_steps=4, top_k=8),
    dict(prompt=6, gen_length=16, block_length=4, editing_threshold=0.0, max_post_steps=2, eos=59,
         eos_early_stop=True),  # planted EOS in the first block: later blocks stay masked
]


@pytest.mark.parametrize("case", LLADA21_CASES)
def test_llada21_editing_matches_reference(models, monkeypatch, case):
    model = models["llada2"]
    case = dict(case)
    prompt, eos = _prompt(case.pop("prompt")), case.pop("eos", 98)
    monkeypatch.setattr(model.cfg, "eos_token_id", eos)
    with torch.no_grad():
        canvas, span = ref_llada21(model, prompt, eos_id=eos, **case)
    edits = []
    out = generate(model, prompt, sampler="llada2", fwd_hooks=[
        ("hook_embed", lambda t, hook: edits.append(model.state))], **case)
    n = prompt.shape[1] + case["gen_length"]
    assert torch.equal(out.tokens, canvas[:, :n])
    assert out.answer_length == [min(span.shape[1], case["gen_length"])]
    n_edits = sum(int(st.extra["edited"].sum()) for st in edits)
    assert int(out.trajectory.n_committed.sum()) >= n_edits
    if case["editing_threshold"] == 0.0:
        assert n_edits > 0  # the planted low threshold does edit decoded tokens
    if case.get("eos_early_stop"):
        assert out.answer_length == [1] and bool((out.generated[0, 2:] == 100).all())


# ---- SDAR -------------------------------------------------------------------------------------------------------
def ref_sdar(model, prompt, *, gen_length, block_length, steps, temperature=1.0, top_k=0, top_p=1.0,
             remasking_strategy="low_confidence_dynamic", confidence_threshold=0.85, eb_threshold=None,
             stopping_criteria_idx=None, mask_id=100, seed=0):
    """block_diffusion_generate with full block-masked forwards in place of its KV cache; transfer_index starts
    empty in the entropy_bounded branch (the reference never creates it there)."""
    gen = torch.Generator().manual_seed(seed)
    prompt_length = prompt.shape[1]
    num_blocks = (prompt_length + gen_length + block_length - 1) // block_length
    total_length = num_blocks * block_length
    position_ids = torch.arange(total_length).unsqueeze(0)
    x = torch.full((1, total_length), mask_id, dtype=torch.long)
    x[:, :prompt_length] = prompt
    schedule = ref_schedule(block_length, steps)
    for num_block in range(prompt_length // block_length, num_blocks):
        lo, hi = num_block * block_length, (num_block + 1) * block_length
        cur_x = x[:, lo:hi].clone()
        for step in range(steps + 1):
            mask_index = cur_x == mask_id
            if mask_index.sum() == 0:
                break
            full = torch.cat([x[:, :lo], cur_x], dim=1)
            logits = model(full, position_ids=position_ids[:, :hi], block_length=block_length)[:, lo:hi]
            x0, x0_p = ref_sample(logits, temperature, top_k, top_p, gen)
            transfer_index = torch.zeros_like(x0, dtype=torch.bool)
            if remasking_strategy == "sequential":
                first = mask_index[0].nonzero(as_tuple=True)[0].min().item()
                transfer_index[0, first:first + schedule[step]] = True
            elif remasking_strategy == "low_confidence_static":
                confidence = torch.where(mask_index, x0_p, -torch.inf)
                _, idx = torch.topk(confidence[0], schedule[step])
                transfer_index[0, idx] = True
            elif remasking_strategy == "low_confidence_dynamic":
                confidence = torch.where(mask_index, x0_p, -torch.inf)
                high = confidence[0] > confidence_threshold
                if high.sum() >= schedule[step]:
                    transfer_index[0] = high
                else:
                    _, idx = torch.topk(confidence[0], schedule[step])
                    transfer_index[0, idx] = True
            else:
                eps = 1e-12
                entropies = -(x0_p.clamp_min(eps) * (x0_p.clamp_min(eps)).log()).sum(dim=-1)
                entropies = torch.where(mask_index, entropies, torch.inf)
                ent_sorted, order = torch.sort(entropies, dim=1, descending=False)
                cumsum = torch.cumsum(ent_sorted, dim=1)
                k = torch.searchsorted(cumsum[0], torch.tensor(eb_threshold), right=False).item()
                k = max(1, min(k, int(mask_index[0].sum().item())))
                transfer_index[0, order[0, :k]] = True
            cur_x[transfer_index] = x0[transfer_index]
        x[:, lo:hi] = cur_x
        if stopping_criteria_idx is not None and any(s in x[:, prompt_length:] for s in stopping_criteria_idx):
            break
    return x


SDAR_CASES = [
    dict(prompt=6, gen_length=12, block_length=4, steps=4),
    dict(prompt=8, gen_length=8, block_length=4, steps=4, confidence_threshold=0.05),
    dict(prompt=5, gen_length=11, block_length=4, steps=2, remasking_strategy="low_confidence_static"),  # rewrite quirk
    dict(prompt=3, gen_length=10, block_length=4, steps=4, remasking_strategy="sequential", temperature=0.7),
    dict(prompt=6, gen_length=12, block_length=4, steps=3, remasking_strategy="low_confidence_dynamic", top_k=5,
         top_p=0.8, temperature=1.3),
    dict(prompt=6, gen_length=12, block_length=4, steps=4, remasking_strategy="entropy_bounded", eb_threshold=8.0),
    dict(prompt=6, gen_length=12, block_length=4, steps=4, remasking_strategy="entropy_bounded", eb_threshold=0.1),
    dict(prompt=4, gen_length=16, block_length=4, steps=4, stopping_criteria_idx=(10,)),
]


@pytest.mark.parametrize("case", SDAR_CASES)
def test_sdar_matches_reference(models, case):
    model = models["sdar"]
    case = dict(case)
    prompt = _prompt(case.pop("prompt"))
    with torch.no_grad():
        canvas = ref_sdar(model, prompt, **case)
    out = generate(model, prompt, sampler="sdar", **case)
    n = prompt.shape[1] + case["gen_length"]
    assert torch.equal(out.tokens, canvas[:, :n])
    stop = case.get("stopping_criteria_idx")
    stop = (stop,) if isinstance(stop, int) else stop
    hit = [] if stop is None else torch.isin(out.tokens[0, prompt.shape[1]:], torch.tensor(stop)).nonzero()[:, 0]
    # the answer ends at the first stop token (inclusive) when one was decoded; else it is the whole gen_length
    assert out.answer_length == ([int(hit[0]) + 1] if len(hit) else None)


def test_sdar_stop_and_prefill_steps(models):
    """A planted stop token halts after its block; step 0 is the prompt's prefill (rows 0..4), each block ends
    with a store forward; every forward computes one block's rows (or the prefill's)."""
    model = models["sdar"]
    rows = []
    out = generate(model, _prompt(4), sampler="sdar", gen_length=16, block_length=4, steps=4,
                   stopping_criteria_idx=(10,),
                   fwd_hooks=[("hook_embed", lambda t, hook: rows.append(
                       (model.state.extra["kind"], t.shape[1], model.state.extra["query_start"], model.state.block)))],
                   record=[ReceivedAttention()])
    gen = out.generated[0]
    assert bool((gen == 10).any())
    last = int((gen != 100).nonzero().max())
    assert last % 4 == 3 and bool((gen[last + 1:] == 100).all()) and last + 1 < 16  # stopped at a block's end
    assert rows[0] == ("prefill", 4, 0, 0)
    assert all(n == 4 and q % 4 == 0 for kind, n, q, _ in rows[1:])
    kinds = [k for k, *_ in rows]
    assert kinds.count("store") == (last + 1) // 4 and kinds[-1] == "store"
    assert out.trajectory.n_steps == len(rows) and out.records["received_attention"].shape[0] == len(rows)


def test_sdar_topk_rewrite_quirk(models):
    """A step whose count exceeds the masks left (3 masks, counts [2, 2]) also picks a -inf position: the
    reference rewrites an already decoded token with this step's sample, and so does the sampler."""
    out = generate(models["sdar"], _prompt(5), sampler="sdar", gen_length=11, block_length=4, steps=2,
                   remasking_strategy="low_confidence_static")
    tr = out.trajectory
    before, after = tr.x_steps[2, 0], tr.x_steps[3, 0]  # step 2: the first block's second denoising forward
    rewritten = ((before != 100) & (after != before)).nonzero().flatten().tolist()
    assert tr.n_committed[2, 0] == 2 and int((before[5:8] == 100).sum()) == 1 and len(rewritten) == 1
    assert tr.commit_step[0, rewritten[0]] == 2 and int(tr.n_committed.sum()) > 11


def test_sdar_block_cache_is_exact(models):
    """Keys/values stored by `append` forwards (the prompt's blocks, then a finished block) and read by a `block`
    forward give the logits of a full block-masked forward (1e-5: different SDPA key sets), and hook_pattern on
    the cached forward is [batch, head, block rows, all keys so far]."""
    from mdm_lens.kvcache import KVCache

    model, x = models["sdar"], _prompt(12)
    cache, shapes = KVCache(model, 12), []
    pos = torch.arange(12)[None]
    with torch.no_grad():
        full = model(x, block_length=4)
        with cache.attached("append"):
            model(x[:, :4], position_ids=pos[:, :4], block_length=4)
            model(x[:, 4:8], position_ids=pos[:, 4:8], block_length=4)
        with cache.attached("block"), model.hooks(fwd_hooks=[("blocks.0.attn.hook_pattern",
                                                                lambda t, hook: shapes.append(tuple(t.shape)))]):
            block = model(x[:, 8:12], position_ids=pos[:, 8:12], block_length=4)
    assert (block - full[:, 8:12]).abs().max() <= 1e-5
    assert shapes == [(1, model.cfg.n_heads, 4, 12)] and cache.layers[0].k.shape[1] == 8  # block mode stores nothing


def test_sdar_invariants(models):
    """steps = block_length with the dynamic rule: every generated slot committed exactly once, prompt untouched."""
    out = generate(models["sdar"], _prompt(5), sampler="sdar", gen_length=11, block_length=4, seed=3)
    tr = out.trajectory
    assert bool((tr.commit_step[0, 5:] >= 0).all()) and int(tr.n_committed.sum()) == 11
    assert torch.equal(out.tokens[0, :5], _prompt(5)[0]) and not bool((out.tokens == 100).any())


# ---- auto, LLaDA-MoE, refusals ----------------------------------------------------------------------------------
def test_auto_picks_family_sampler(models):
    assert [default_sampler(models[k]) for k in ("llada2", "sdar", "lladamoe")] == ["llada2", "sdar", "llada"]
    p = _prompt(5)
    a = generate(models["lladamoe"], p, gen_length=8, steps=8)
    b = generate(models["lladamoe"], p, sampler="llada", gen_length=8, steps=8)
    assert a.sampler == "llada" and torch.equal(a.tokens, b.tokens) and not bool((a.tokens == 100).any())
    assert generate(models["sdar"], p, gen_length=4, block_length=4).sampler == "sdar"
    bound = plan(models["sdar"], gen_length=8, block_length=4)  # prompt unknown: the longest layout
    assert bound.n_steps == 1 + 5 * 3 and bound.n_blocks == 3 and bound.adaptive
    for n in (1, 4, 6):  # the bound holds the real runs' forwards
        assert generate(models["sdar"], _prompt(n), gen_length=8, block_length=4).n_steps <= bound.n_steps


@pytest.mark.parametrize("name,kwargs,error,argument", [
    ("sdar", dict(temperature=0.0), SamplerConfigError, "temperature"),
    ("sdar", dict(remasking_strategy="entropy_bounded"), SamplerConfigError, "eb_threshold"),
    ("sdar", dict(remasking_strategy="greedy"), SamplerConfigError, "remasking_strategy"),
    ("sdar", dict(record=[KeyValueNorms()]), SamplerConfigError, "record"),
    ("sdar", dict(denoising_steps=4), SamplerConfigError, "denoising_steps"),
    ("llada2", dict(minimal_topk=13), SamplerConfigError, "minimal_topk"),
    ("llada2", dict(top_k=1000), SamplerConfigError, "top_k"),
    ("llada2", dict(gen_length=600), SamplerConfigError, "gen_length"),
    ("llada2", dict(prompt=torch.tensor([[5, 98, 7]]), eos_early_stop=True), InputError, "prompt"),
    ("llada2", dict(prompt=torch.tensor([[5, 6], [7, 8]])), SamplerConfigError, "prompt"),
    ("llada2", dict(cfg_scale=1.0), SamplerConfigError, "cfg_scale"),
    ("llada2", dict(editing_threshold=0.9, steps=4), SamplerConfigError, "steps"),
    ("llada2", dict(max_post_steps=4), SamplerConfigError, "max_post_steps"),
    ("llada2", dict(editing_threshold=0.9, num_to_transfer=5), SamplerConfigError, "num_to_transfer"),
])
def test_refused_before_compute(models, name, kwargs, error, argument):
    model = models[name]
    kwargs = dict(kwargs)
    prompt = kwargs.pop("prompt", _prompt(4))
    calls = []
    kwargs.setdefault("gen_length", 12)
    with pytest.raises(error) as info:
        generate(model, prompt, sampler=name, block_length=4,
                 fwd_hooks=[("hook_embed", lambda t, hook: calls.append(1))], **kwargs)
    assert info.value.argument == argument and calls == []
