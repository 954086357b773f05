"""Fast-dLLM v2: the loader (real `Fast_dLLM_QwenForCausalLM` layout, no remote code), the forward against
transformers' Qwen2 with the reference's eval mask, and `sampler="fastdllm_v2"` token for token against the
transcription of `batch_sample` (tests/fastdllm_v2_reference.py; NikhilSDate/Fast-dLLM v2/generation_functions.py
@ 734a60d4b3ff33660ba666c8c5d71236f84a42e5 and the Fast_dLLM_v2 modeling.py of the code index), plus planted cases
(threshold boundary, sub-block counts, stop token) on a model whose logits are pinned by a hook."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from safetensors.torch import save_file

from fastdllm_v2_reference import RefModel, batch_sample
from mdm_lens import HookedMDM, MDMConfig
from mdm_lens.errors import InputError, SamplerConfigError
from sampler_rigs import identity_unembed
from tiny_checkpoints import hf_reference

MASK, PAD = 96, 0


def write_fastdllm_v2(folder, seed: int = 3, bd_size: int = 4):
    """A tiny random checkpoint in the released layout: Qwen2 key names, the Fast_dLLM_Qwen config.json (auto_map
    pointing at remote code that must never run), the mask token named `|<MASK>|` in the tokenizer files."""
    ref = hf_reference("qwen2", seed=seed)
    c = ref.config
    config = {"architectures": ["Fast_dLLM_QwenForCausalLM"], "model_type": "Fast_dLLM_Qwen", "bd_size": bd_size,
              "auto_map": {"AutoConfig": "configuration.Fast_dLLM_QwenConfig",
                           "AutoModelForCausalLM": "modeling.Fast_dLLM_QwenForCausalLM"},
              "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
              "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
              "num_key_value_heads": c.num_key_value_heads, "vocab_size": c.vocab_size, "hidden_act": "silu",
              "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 32768, "use_sliding_window": False,
              "sliding_window": None, "layer_types": ["full_attention"] * c.num_hidden_layers,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {str(MASK): {"content": "|<MASK>|"}}}))
    (folder / "modeling.py").write_text("raise RuntimeError('remote code was executed')\n")
    sd = {k: v.detach().contiguous().clone() for k, v in ref.state_dict().items()}
    save_file(sd, str(folder / "model.safetensors"))
    return folder, config, sd, ref


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder, config, sd, ref = write_fastdllm_v2(tmp_path_factory.mktemp("fastdllm_v2"))
    model = HookedMDM.from_pretrained(str(folder), load_tokenizer=False)
    return model, RefModel(config, sd), ref


def test_loader_reads_the_released_layout(tiny):
    model, _, _ = tiny
    c = model.cfg
    assert (c.family, c.mask_token_id, c.extra["block_length"], c.logit_shift, c.attention, c.qkv_bias) == \
        ("fastdllm_v2", MASK, 4, True, "block_causal", True)
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.d_vocab, c.rope_theta) == (2, 64, 4, 2, 97, 1e6)
    assert c.pad_token_id is None  # neither config.json nor the tokenizer names one


def test_pad_id_from_the_tokenizer(tmp_path):
    folder = write_fastdllm_v2(tmp_path / "ckpt")[0]
    (folder / "tokenizer_config.json").write_text(json.dumps({"pad_token": "<|endoftext|>", "added_tokens_decoder": {
        "7": {"content": "<|endoftext|>"}, str(MASK): {"content": "|<MASK>|"}}}))
    model = HookedMDM.from_pretrained(str(folder), load_tokenizer=False)
    assert (model.cfg.pad_token_id, model.cfg.mask_token_id) == (7, MASK)


def test_forward_matches_transformers_qwen2_with_the_eval_mask(tiny):
    model, ref_model, ref = tiny
    tokens = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(0))
    q = torch.arange(11)
    for bs in (4, 3, 11):
        visible = (q[:, None] // bs) >= (q[None, :] // bs)  # eval_mask / eval_block_diff_mask
        additive = torch.zeros(11, 11).masked_fill(~visible, float("-inf"))[None, None].expand(2, 1, 11, 11)
        with torch.no_grad():
            want = ref(tokens, attention_mask=additive).logits
            got = model(tokens, block_length=bs)
        assert (got - want).abs().max() <= 1e-4
        assert (ref_model.forward(tokens, block_size=bs).logits - want).abs().max() <= 1e-4
    assert torch.equal(model(tokens), model(tokens, block_length=4))  # bd_size is the default block
    aligned = model(tokens, return_type="aligned")
    assert torch.equal(aligned[:, 1:], model(tokens)[:, :-1])  # token shift: logit i predicts token i+1


def reference_run(ref_model, prompts, **kw):
    lengths = torch.tensor([len(p) for p in prompts])
    ids = torch.full((len(prompts), int(lengths.max())), MASK, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, :len(p)] = torch.tensor(p)
    torch.manual_seed(kw.pop("seed", 0))
    return batch_sample(ref_model, ids, PAD, min_len=int(lengths.min()), seq_len=lengths, mask_id=MASK, **kw)


def ours(model, prompts, **kw):
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    am = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p)
        am[r, width - len(p):] = 1
    return model.generate(ids, attention_mask=am, sampler="fastdllm_v2", pad_id=PAD, **kw)


def assert_same(out, done, nfe, prompts):
    returned = out.settings["returned_lengths"]
    for r in range(len(prompts)):
        assert returned[r] == len(done[r])
        assert out.tokens[r, :returned[r]].tolist() == done[r].tolist()
        assert (out.tokens[r, returned[r]:] == PAD).all() and int(out.attention_mask[r].sum()) == returned[r]
    assert out.settings["n_forwards"] == nfe == out.trajectory.n_steps
    # every generated slot committed exactly once (pads written after a stop token keep their first commit)
    cs = out.trajectory.commit_step
    for r, p in enumerate(prompts):
        gen = slice(len(p), returned[r])
        assert (cs[r, :len(p)] == -1).all() and (cs[r, gen] >= 0).all() and (cs[r, returned[r]:] == -2).all()
        assert int(out.trajectory.n_committed[:, r].sum()) == returned[r] - len(p)


P6 = [5, 17, 33, 2, 61, 40]
CASES = {
    "greedy": dict(prompts=[P6], kw=dict(threshold=0.03, small_block_size=2, max_new_tokens=12)),
    "block_cache": dict(prompts=[P6], kw=dict(threshold=0.03, small_block_size=2, max_new_tokens=12,
                                               use_block_cache=True)),
    "one_sub_block": dict(prompts=[P6[:3]], kw=dict(threshold=0.03, small_block_size=4, max_new_tokens=8)),
    "sbs_1": dict(prompts=[P6[:5]], kw=dict(threshold=0.0, small_block_size=1, max_new_tokens=8)),
    "factor": dict(prompts=[P6], kw=dict(factor=True, factor_value=3.0, small_block_size=4, max_new_tokens=8)),
    "sampled": dict(prompts=[P6], kw=dict(temperature=0.7, top_p=0.9, threshold=0.2, small_block_size=2,
                                          max_new_tokens=8, seed=5)),
    "prompt_fills_blocks": dict(prompts=[P6 + [7, 9]], kw=dict(threshold=0.03, small_block_size=2,
                                                               max_new_tokens=8)),
    "batch": dict(prompts=[P6[:3], P6, P6 + [7, 9, 11, 13, 15, 19]],
                  kw=dict(threshold=0.03, small_block_size=2, max_new_tokens=8, use_block_cache=True)),
    "batch_block_end": dict(prompts=[P6[:5], P6 + [7, 9], P6 + [7, 9, 11, 13, 15, 19]],
                            kw=dict(threshold=0.03, small_block_size=2, max_new_tokens=8)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_token_exact_against_the_transcription(tiny, case):
    model, ref_model, _ = tiny
    prompts, kw = CASES[case]["prompts"], dict(CASES[case]["kw"], block_size=4, stop_token=95)
    done, nfe = reference_run(ref_model, prompts, **kw)
    seed = kw.pop("seed", 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = ours(model, prompts, seed=seed, **kw)
    assert_same(out, done, nfe, prompts)


def test_stop_tokens_end_rows_at_different_blocks(tiny):
    model, ref_model, _ = tiny
    prompts = [P6[:3], P6]
    kw = dict(threshold=0.03, small_block_size=2, max_new_tokens=12, block_size=4, stop_token=95)
    free = ours(model, prompts, **kw)
    stop = int(free.tokens[0, 6])  # a token row 0 commits inside its second block
    kw["stop_token"] = stop
    done, nfe = reference_run(ref_model, prompts, **kw)
    out = ours(model, prompts, **kw)
    assert_same(out, done, nfe, prompts)
    row = out.tokens[0, :out.settings["returned_lengths"][0]]
    first = 3 + int((row[3:] == stop).nonzero()[0, 0])
    assert (row[first + 1:] == PAD).all() and out.settings["returned_lengths"][0] < free.settings["returned_lengths"][0]


def test_quirks_are_warned_and_reproduced(tiny):
    model, ref_model, _ = tiny
    kw = dict(threshold=0.03, small_block_size=2, max_new_tokens=8, block_size=4, stop_token=95)
    with pytest.warns(UserWarning, match="never reads its first block"):
        out = ours(model, [P6[:4]], **kw)
    assert_same(out, *reference_run(ref_model, [P6[:4]], **kw), [P6[:4]])
    prompts = [P6, P6 + [7, 9, 11]]  # the longest prompt is one token past a block end
    with pytest.warns(UserWarning, match="overwrites the last prompt token"):
        out = ours(model, prompts, **kw)
    assert_same(out, *reference_run(ref_model, prompts, **kw), prompts)


def test_refusals(tiny):
    model, _, _ = tiny
    bad = [dict(small_block_size=3), dict(max_new_tokens=3), dict(block_size=3, small_block_size=1),
           dict(small_block_size=8)]
    for kw in bad:
        with pytest.raises(SamplerConfigError):
            ours(model, [P6], block_size=kw.pop("block_size", 4), stop_token=95, **kw)
    with pytest.raises(SamplerConfigError, match="row 0's distribution"):
        ours(model, [P6, P6[:3]], block_size=4, small_block_size=2, stop_token=95, temperature=0.5)
    with pytest.raises(InputError, match="mask token"):
        ours(model, [P6 + [MASK]], block_size=4, small_block_size=2, stop_token=95)


# --- planted logits --------------------------------------------------------------------------------------------
V = 50


def planted_model():
    cfg = MDMConfig(d_model=64, n_layers=1, n_heads=2, n_kv_heads=2, d_mlp=32, d_vocab=V, mask_token_id=49,
                    attention="bidirectional", logit_shift=True, n_ctx=64, pad_token_id=0, eos_token_id=1,
                    family="fastdllm_v2", extra={"block_length": 4})
    return identity_unembed(HookedMDM.from_config(cfg, seed=0, init_std=0.1), scale=1.0)


def plant(model, table, log):
    """Raw row q predicts position q + 1: `table[pos] = (token, logit)`, all other logits 0 (a flat rest)."""

    def hook(x, hook):
        st = model.state
        lo, hi = st.extra["query_start"], st.extra["query_end"]
        log.append((st.extra["kind"], st.extra["sub_block"], lo, hi, st.block))
        out = torch.zeros_like(x)
        for i, q in enumerate(range(lo, hi)):
            token, logit = table.get(q + 1, (3, 0.5))
            out[:, i, token] = logit
        return out

    return [("ln_final.hook_normalized", hook)]


def confidence(logit: float) -> float:
    row = torch.zeros(1, 1, V)
    row[..., 10] = logit
    return float(torch.softmax(row, dim=-1)[0, 0, 10])


@pytest.mark.parametrize("nudge,first_commit", [(0, {5}), (-1, {5, 6})])
def test_threshold_is_strict_at_the_boundary(nudge, first_commit):
    model, log = planted_model(), []
    table = {5: (10, 7.0), 6: (10, 6.0), 7: (12, 2.0), 8: (13, 9.0)}
    threshold = confidence(6.0)
    if nudge:  # one float32 ulp below (the comparison runs in the probabilities' float32)
        t = torch.tensor(threshold, dtype=torch.float32)
        threshold = float(torch.nextafter(t, torch.tensor(-math.inf)))
    out = model.generate([20, 21, 22, 23, 24], sampler="fastdllm_v2", block_size=4, small_block_size=4,
                         max_new_tokens=4, threshold=threshold, stop_token=1, fwd_hooks=plant(model, table, log))
    assert out.tokens[0].tolist() == [20, 21, 22, 23, 24, 10, 10, 12, 13]
    assert set(out.trajectory.committed_at(1)[0].nonzero().flatten().tolist()) == first_commit
    kinds = [k for k, *_ in log]
    assert kinds == ["prefill"] + ["denoise"] * (4 - len(first_commit)) + ["ar"]


@pytest.mark.parametrize("sbs", [1, 2, 4])
def test_sub_blocks_decode_in_order(sbs):
    model, log = planted_model(), []
    out = model.generate([20, 21], sampler="fastdllm_v2", block_size=4, small_block_size=sbs, max_new_tokens=4,
                         threshold=0.0, stop_token=1, fwd_hooks=plant(model, {}, log))
    # positions 2, 3 masked: everything passes threshold 0, so each sub-block holding a mask takes one forward
    subs = [s for k, s, *_ in log if k == "denoise"]
    assert subs == {1: [2, 3], 2: [1], 4: [0]}[sbs]
    assert log[-1][:4] == ("ar", None, 0, 4) and out.tokens[0].tolist() == [20, 21, 3, 3, 3]


def test_stop_token_pads_the_rest_and_skips_the_ar_step():
    model, log = planted_model(), []
    table = {2: (1, 9.0), 3: (7, 8.0)}  # position 2 commits the stop token 1, then position 3 commits 7
    out = model.generate([20, 21], sampler="fastdllm_v2", block_size=4, small_block_size=4, max_new_tokens=8,
                         threshold=0.99, stop_token=1, fwd_hooks=plant(model, table, log))
    assert out.tokens[0].tolist() == [20, 21, 1, 0]  # the token after the stop token became pad
    assert out.trajectory.commit_step[0].tolist() == [-1, -1, 0, 1]
    assert [k for k, *_ in log] == ["denoise", "denoise"]  # the only row finished: no AR forward


def test_block_cache_forwards_match_the_reference_logits(tiny):
    """`use_block_cache`: the sub-block forwards (stale block keys/values, fresh rows written in place) compute the
    reference's logits, which differ from a full block forward's."""
    model, ref_model, _ = tiny
    kw = dict(threshold=1.0, small_block_size=4, max_new_tokens=16, block_size=8, stop_token=95,
              use_block_cache=True)  # one commit per forward: sub-block windows follow each fill
    theirs, forward = [], ref_model.forward

    def recording(*args, **kwargs):
        out = forward(*args, **kwargs)
        theirs.append(out.logits)
        return out

    ref_model.forward = recording
    try:
        reference_run(ref_model, [P6], **kw)
    finally:
        del ref_model.forward
    mine, rows, canvases = [], [], []

    def hook(x, hook):
        mine.append(model.unembed(x * model.ln_final.w))  # hook_normalized is before the weight
        rows.append(model.state.extra["block_cache"])
        canvases.append(model.state.x.clone())

    ours(model, [P6], fwd_hooks=[("ln_final.hook_normalized", hook)], **kw)
    assert len(mine) == len(theirs) and rows.count("window") >= 2
    for a, b in zip(mine, theirs):
        assert a.shape == b.shape and (a - b).abs().max() <= 1e-4
    i = rows.index("window")
    fresh = model(canvases[i][:, :8], block_length=8)[:, 4:8]  # block 0 recomputed from its current tokens
    assert (fresh - mine[i]).abs().max() > 1e-3  # the stale block keys/values matter


def test_observation_limits(tiny):
    from mdm_lens.hooks.reducers import KeyValueNorms, ReceivedAttention

    model, _, _ = tiny
    kw = dict(block_size=4, small_block_size=2, threshold=0.03, max_new_tokens=8, stop_token=95)
    out = ours(model, [P6], record=[ReceivedAttention()], cache="blocks.0.attn.hook_pattern", **kw)
    shapes = [tuple(out.cache[i]["blocks.0.attn.hook_pattern"].shape[-2:]) for i in range(out.trajectory.n_steps)]
    assert shapes == [(4, 4)] + [(4, 8)] * (shapes.count((4, 8))) + [(4, 12)] * (shapes.count((4, 12)))
    assert shapes.count((4, 8)) >= 2 and shapes.count((4, 12)) >= 2  # prefill; block 1 (+ AR); block 2 (+ AR)
    assert out.records["received_attention"].shape[-1] == out.tokens.shape[1]
    with pytest.raises(SamplerConfigError, match="KeyValueNorms"):
        ours(model, [P6], record=[KeyValueNorms()], **kw)
    logits = out.replay(model, 1)  # the block cache is exact: one block-causal forward over [0, query_end)
    assert logits.shape[1] == out.trajectory.forwards[1]["extra"]["query_end"] == 8


def test_defaults_and_missing_ids(tiny):
    from mdm_lens.diffusion import plan

    model, _, _ = tiny
    assert plan(model, small_block_size=2, max_new_tokens=8, stop_token=95, pad_id=PAD).n_blocks == 2
    out = model.generate([P6], small_block_size=2, max_new_tokens=8, threshold=0.03, stop_token=95, pad_id=PAD)
    assert out.sampler == "fastdllm_v2" and out.settings["block_size"] == 4  # auto: the family's; bd_size
    assert (out.settings["threshold"], out.settings["top_p"], out.settings["temperature"]) == (0.03, 0.95, 0.0)
    for missing, given in (("stop_token", dict(pad_id=PAD)), ("pad_id", dict(stop_token=95))):
        with pytest.raises(SamplerConfigError) as info:  # vocab 97: no 151645, no EOS, no pad in this config
            model.generate([P6], small_block_size=2, max_new_tokens=8, **given)
        assert info.value.argument == missing


def test_a_stop_token_from_the_ar_step_does_not_stop_the_row_but_anchors_the_padding():
    model, log = planted_model(), []
    table = {4: (1, 9.0), 5: (9, 5.0), 6: (1, 9.0)}  # the AR step emits the stop token 1 at position 4
    out = model.generate([20, 21], sampler="fastdllm_v2", block_size=4, small_block_size=4, max_new_tokens=8,
                         threshold=0.99, stop_token=1, fwd_hooks=plant(model, table, log))
    # block 1 still decodes (9 at 5, the stop token at 6 ends the row, 3 at 7); the padding then starts after the
    # first stop token from the prompt's end on, the AR one at 4
    assert [k for k, *_ in log] == ["denoise", "denoise", "ar", "denoise", "denoise", "denoise"]
    assert out.tokens[0].tolist() == [20, 21, 3, 3, 1, 0, 0, 0]
    assert out.trajectory.commit_step[0].tolist() == [-1, -1, 0, 1, 2, 4, 3, 5]
