"""The floating probes on DiffusionGemma runs: planted anchors are found over steps (absent keys are
never anchors), the QK split at a step equals its closed form; the whole-sequence probes (prompt through the
encoder, the answer as the decoder's canvas) equal hand computations from transformers' eager attentions."""

from __future__ import annotations

import copy

import pytest
import torch

from mdm_lens import ReceivedAttention, steps
from mdm_lens.bridge import TransformersBridge
from mdm_lens.bridge.probes import qk_at_step
from mdm_lens.bridge.tiny import tiny_diffusion_gemma
from mdm_lens.errors import ArgumentError, InputError
from mdm_lens.probes import run


@pytest.fixture(scope="module")
def bridge():
    return TransformersBridge(tiny_diffusion_gemma(seed=1))


def _ids():
    return torch.randint(2, 128, (2, 5), generator=torch.Generator().manual_seed(0))


def test_planted_anchor_is_found_at_every_step(bridge):
    def plant(pattern, hook):  # every canvas query of layer 1 attends to key 2 only
        planted = torch.zeros_like(pattern)
        planted[..., 2] = 1.0
        return planted

    out = bridge.generate(_ids(), seed=2, max_new_tokens=16, max_denoising_steps=3, record=[ReceivedAttention()],
                          fwd_hooks=[("blocks.1.attn.hook_pattern", plant)])
    sa = run.anchors_over_steps(out, layer=1)
    assert sa.anchors.shape == (2, 6, 21)
    expected = torch.zeros(2, 6, 21, dtype=torch.bool)
    expected[..., 2] = True
    assert torch.equal(sa.anchors, expected)
    assert sa.received[:, :3, 13:].isnan().all()  # canvas 1 does not exist during canvas 0's steps
    drift = run.drift_from_output(out, layer=1)
    assert torch.allclose(torch.as_tensor(drift.mean_jaccard, dtype=torch.float64), torch.ones(2, dtype=torch.float64))
    # unplanted layer 0 is a real, different distribution
    assert not torch.equal(run.anchors_over_steps(out, layer=0).anchors, expected)


def test_qk_at_step_equals_closed_form(bridge):
    names = [f"blocks.1.attn.{n}" for n in ("hook_rot_q", "hook_rot_k", "hook_v", "hook_pattern")]
    out = bridge.generate(_ids(), seed=3, max_new_tokens=16, max_denoising_steps=3, cache=names @ steps(1, 4))
    for step, n_keys in ((1, 13), (4, 21)):
        res = qk_at_step(out, step, layer=1)
        c = out.cache[step]
        q = c["blocks.1.attn.hook_rot_q"].double()
        k = c["blocks.1.attn.hook_rot_k"].double()
        assert k.shape[1] == n_keys
        k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
        dots = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
        for b in range(2):
            a = int(res.anchor[b, 0])
            rest = torch.cat([dots[b, ..., :a], dots[b, ..., a + 1:]], dim=-1)
            expected = (dots[b, ..., a : a + 1] - rest).mean(-1).mean(-1)
            assert torch.allclose(res.advantage[b], expected, atol=1e-10)
        assert torch.allclose(res.norm_term + res.angle_term, res.advantage)
    with pytest.raises(InputError, match="cached at step 2"):
        qk_at_step(out, 2, layer=1)


def test_qk_at_step_on_a_sliding_layer_skips_the_keys_its_cache_dropped(bridge):
    """Layer 0 slides (window 4): at canvas 0 it reads prompt keys 2..4 only (cache of W-1 = 3) + the canvas."""
    names = [f"blocks.0.attn.{n}" for n in ("hook_rot_q", "hook_rot_k", "hook_v", "hook_pattern")]
    out = bridge.generate(_ids(), seed=3, max_new_tokens=8, max_denoising_steps=2, cache=names @ steps(1))
    res = qk_at_step(out, 1, layer=0)
    c = out.cache[1]
    q, k = c["blocks.0.attn.hook_rot_q"].double(), c["blocks.0.attn.hook_rot_k"].double()
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    dots = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
    for b in range(2):
        a = int(res.anchor[b, 0])
        assert 2 <= a < 13
        vis = [j for j in range(2, 13) if j != a]
        expected = (dots[b, ..., a:a + 1] - dots[b][..., vis]).mean(-1).mean(-1)
        assert torch.allclose(res.advantage[b], expected, atol=1e-10)


def _eager_pair(seed=1, **kw):
    ref = tiny_diffusion_gemma(seed=seed, **kw)
    eager = copy.deepcopy(ref)
    eager.set_attn_implementation("eager")
    return TransformersBridge(ref), eager


def test_absorption_equals_a_hand_computation_from_eager_attentions():
    """Q = the answer rows (the decoder's queries); keys = what each decoder layer lets them see, which sets the
    null: eager output_attentions of the sliding layer keep only the last window - 1 prompt keys."""
    bridge, eager = _eager_pair(sliding_window=4)
    g = torch.Generator().manual_seed(5)
    prompt, answer = torch.randint(2, 128, (2, 7), generator=g), torch.randint(2, 128, (2, 5), generator=g)
    with torch.no_grad():
        atts = eager(input_ids=prompt, decoder_input_ids=answer, output_attentions=True).attentions
    res = run.absorption_by_layer(bridge, torch.cat([prompt, answer], 1), prompt_length=7)
    assert [a.shape[-1] for a in atts] == [8, 12, 12]                   # layer 0 slides: 3 prompt keys + 5
    for l, a in enumerate(atts):
        m = a.double().mean(1).mean(1)                                   # [batch, visible key]
        n = a.shape[-1]
        first = 12 - n                                                   # the first key this layer sees
        assert torch.allclose(res.per_sample[:, l, 0], 100 * m[:, 0], atol=1e-4)          # pos0: first visible key
        assert torch.allclose(res.per_sample[:, l, 1], 100 * m.max(-1).values, atol=1e-4)  # top1
        assert torch.allclose(res.null[:, l, :2], torch.full((2, 2), 100 / n, dtype=torch.float64))
        assert first == (4 if l == 0 else 0)
    with pytest.raises(ArgumentError, match="prompt_length"):
        run.absorption_by_layer(bridge, torch.cat([prompt, answer], 1))
    with pytest.raises(ArgumentError, match=r"prompt_length=12 .*\[1, 11\]"):
        run.absorption_by_layer(bridge, torch.cat([prompt, answer], 1), prompt_length=12)
    with pytest.raises(ArgumentError, match="chunked=True"):
        run.absorption_by_layer(bridge, torch.cat([prompt, answer], 1), prompt_length=7, chunked=True)


def test_planted_decoder_pattern_gives_the_closed_form_absorption():
    bridge, _ = _eager_pair()
    tokens = torch.randint(2, 128, (2, 12), generator=torch.Generator().manual_seed(6))

    def plant(pattern, hook):  # every answer row: 0.6 on key 3, the rest spread evenly over the other keys
        out = torch.full_like(pattern, 0.4 / (pattern.shape[-1] - 1))
        out[..., 3] = 0.6
        return out

    with bridge.hooks(fwd_hooks=[("blocks.2.attn.hook_pattern", plant)]):
        res = run.absorption_by_layer(bridge, tokens, prompt_length=7, layers=[2])
    top1, pos0 = res.per_sample[:, 0, 1], res.per_sample[:, 0, 0]
    assert torch.allclose(top1, torch.full((2,), 60.0, dtype=torch.float64))
    assert torch.allclose(pos0, torch.full((2,), 40 / 11, dtype=torch.float64))
    assert not any(h.fwd_hooks for h in bridge.hook_dict.values())


def test_left_padding_is_hidden_and_prompt_rows_are_no_queries():
    bridge, _ = _eager_pair(sliding_window=64)
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(2, 128, (2, 12), generator=g)
    am = torch.ones(2, 12, dtype=torch.long)
    am[1, :3] = 0
    alone = run.absorption_by_layer(bridge, tokens[1:, 3:], prompt_length=4)
    padded = run.absorption_by_layer(bridge, tokens, attention_mask=am, prompt_length=7)
    assert torch.allclose(padded.per_sample[1], alone.per_sample[0], atol=1e-5)
    assert torch.allclose(padded.null[1, :, :2], torch.full((3, 2), 100 / 9, dtype=torch.float64))
    attn = run.final_attention(bridge, tokens, prompt_length=7)          # [b, l, h, T, T]
    assert torch.allclose(attn.sum(-1), torch.ones(()).double().float(), atol=1e-5)  # every row is a distribution
    assert attn[..., :7, 7:].abs().max() == 0                             # prompt rows: the causal encoder's own
    assert attn[..., :7, :7].triu(1).abs().max() == 0


def test_qk_at_layer_equals_the_closed_form_over_visible_keys():
    bridge, _ = _eager_pair(sliding_window=4)
    tokens = torch.randint(2, 128, (2, 12), generator=torch.Generator().manual_seed(8))
    from mdm_lens.bridge.sequence import sequence_forward

    for layer in (0, 1):                                                 # sliding, full
        res = run.qk_at_layer(bridge, tokens, layer, prompt_length=7)
        view = sequence_forward(bridge, tokens, 7, layers=[layer], hooks=("hook_rot_q", "hook_rot_k"))
        q = view.cache[f"blocks.{layer}.attn.hook_rot_q"][:, 7:].double()   # the answer rows
        k = view.cache[f"blocks.{layer}.attn.hook_rot_k"].double()
        k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
        dots = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
        seen = view.key_visible[layer]
        assert int(seen[0].sum()) == (8 if layer == 0 else 12)
        for b in range(2):
            a = int(res.anchor[b, 0])
            others = [j for j in range(12) if seen[b, j] and j != a]
            expected = (dots[b, ..., a: a + 1] - dots[b, ..., others]).mean(-1).mean(-1)
            assert torch.allclose(res.advantage[b], expected, atol=1e-10)
    with pytest.raises(ArgumentError, match="no masked"):
        run.qk_at_layer(bridge, tokens, 1, query="masked", prompt_length=7)
    prompt_rows = torch.zeros(2, 12, dtype=torch.bool)
    prompt_rows[:, 2] = True
    with pytest.raises(ArgumentError, match="prompt rows"):
        run.qk_at_layer(bridge, tokens, 1, query=prompt_rows, prompt_length=7)


def test_flow_runs_on_diffusion_gemma_with_the_generated_answer():
    from mdm_lens.zoo import data as D
    from mdm_lens.zoo import tokenizer as ZT

    # items are text: the probes read them with the model's own tokenizer (here the zoo's, vocab 322)
    bridge = TransformersBridge(tiny_diffusion_gemma(seed=0, vocab_size=322, sliding_window=16),
                                tokenizer=ZT.load_tokenizer())
    items = D.make_dataset(2, seed=3, n_distractors=2)
    res = run.flow_for_items(bridge, items, gen_length=4, steps=2)
    df = res.to_frame()
    rows = df[df.metric == "answer_row"].groupby("item").value.sum()
    assert all(abs(v - 1.0) < 1e-6 for v in rows) and torch.isfinite(res.gold_ratio).all()
    # DiffusionGemma fills whole canvases: the answer region is the 8 generated tokens, not gen_length
    assert all(len(a.split()) == 8 for a in res.answers)


def test_topk_keys_index_canvas_queries_by_absolute_position(bridge):
    """TopKKeys on the decoder: query rows sit at the canvas's absolute positions (retrieval reads them there)."""
    from mdm_lens.hooks.reducers import TopKKeys

    def plant(pattern, hook):  # query row i (absolute position start + i) attends to key start + i - 1 only
        n_q, n_k = pattern.shape[-2:]
        out = torch.zeros_like(pattern)
        rows = torch.arange(n_q)
        out[..., rows, n_k - n_q + rows - 1] = 1.0
        return out

    out = bridge.generate(_ids(), seed=2, max_new_tokens=16, max_denoising_steps=2, record=[TopKKeys(k=1, layers=[1])],
                          fwd_hooks=[("blocks.1.attn.hook_pattern", plant)])
    top = out.records["topk_keys"][:, 0, 0, 0, :, 0]                      # [step, query]
    assert top.shape == (4, 21)
    for s, start in ((0, 5), (1, 5), (2, 13), (3, 13)):                  # two canvases of 8 after a 5-token prompt
        expected = torch.full((21,), TopKKeys.ABSENT)  # query rows that do not exist at the step: no key
        expected[start:start + 8] = torch.arange(start, start + 8) - 1
        assert torch.equal(top[s], expected)


def test_probes_that_cannot_apply_say_why(bridge):
    from mdm_lens.probes import patching

    with pytest.raises(InputError, match="patch_anchor_activations does not apply"):
        patching.patch_anchor_activations(bridge, _ids()[:1], _ids()[:1])


@pytest.fixture(scope="module")
def zoo_pair():
    from mdm_lens.zoo import tokenizer as ZT

    hf = tiny_diffusion_gemma(seed=2, vocab_size=ZT.vocab_size())
    ref = copy.deepcopy(hf)
    ref.set_attn_implementation("eager")
    return ref, TransformersBridge(hf, tokenizer=ZT.load_tokenizer())  # the probes read text with it


@torch.no_grad()
def _eager_sequence(ref, tokens, P):
    """transformers' eager attentions placed on the whole sequence: decoder rows at the answer positions (absolute
    keys), encoder rows (causal) at the prompt positions: [b, layer, head, T, T]."""
    from transformers import DynamicCache

    T = tokens.shape[1]
    out = ref(input_ids=tokens[:, :P], decoder_input_ids=tokens[:, P:],
              cache=DynamicCache(config=ref.config.text_config), output_attentions=True)
    enc = ref.model.encoder(input_ids=tokens[:, :P], cache=DynamicCache(config=ref.config.text_config),
                            output_attentions=True).attentions
    full = torch.zeros(tokens.shape[0], len(out.attentions), out.attentions[0].shape[1], T, T, dtype=torch.float64)
    for l, (a, e) in enumerate(zip(out.attentions, enc)):
        full[:, l, :, P:, T - a.shape[-1]:] = a.double()
        full[:, l, :, :P, :P] = e.double()
    return full


def test_flow_equals_the_rollout_of_eager_encoder_and_decoder_attentions(zoo_pair):
    from mdm_lens.probes import flow as F
    from mdm_lens.zoo import data as D
    from mdm_lens.zoo import tokenizer as ZT

    ref, bridge = zoo_pair
    item = D.make_dataset(1, seed=3, n_distractors=2)[0]
    res = run.flow_for_items(bridge, [item], gen_length=4, steps=2)
    ids, offsets = ZT.encode_with_offsets(item.prompt)
    tokens = bridge.generate(torch.tensor([ids]), gen_length=4, steps=2).tokens
    p, T = len(ids), tokens.shape[1]
    assert T == p + 8                                                    # one whole canvas, not gen_length
    full = _eager_sequence(ref, tokens, p)[0]
    assert torch.allclose(run.final_attention(bridge, tokens, prompt_length=p)[0].double(), full, atol=1e-6)
    hand = F.flow(full.mean(1), run.regions_for_item(item, T - p, offsets), warn=False)
    got = res.results[0]
    assert [r.name for r in got.regions] == [r.name for r in hand.regions]
    assert torch.allclose(got.answer_row, hand.answer_row, atol=1e-6)
    assert torch.allclose(got.flow, hand.flow, atol=1e-6)
    assert res.answers == [ZT.decode(tokens[0, p:].tolist())]


def test_retrieval_finds_a_planted_copy_head_on_the_decoder(zoo_pair):
    from mdm_lens.probes import retrieval as RT

    _, bridge = zoo_pair
    p = torch.arange(10) + 40                                            # distinct prompt tokens
    needle, other = 4, 7
    w = int(p[needle])

    def copy_to(head, key):
        def hook(pattern, hook):                                         # every canvas row of `head` → key
            new = pattern.clone()
            new[:, head] = 0
            new[:, head, :, key] = 1
            return new
        return hook

    def emit(x, hook):                                                   # canvas row 0 emits w (tied embeddings)
        y = x.clone()
        y[:, 0] = bridge.W_E[w] / bridge.W_E[w].norm() * 1e3
        return y

    hooks = [("blocks.1.attn.hook_pattern", copy_to(2, needle)), ("blocks.0.attn.hook_pattern", copy_to(1, other)),
             ("ln_final.hook_out", emit)]
    for method in ("copy@commit", "copy@any", "copy@final"):
        res = RT.retrieval_scores(bridge, [RT.RetrievalItem(p, [(needle, needle + 1)], [w])], method=method,
                                  gen_length=4, steps=2, fwd_hooks=hooks)
        assert res.n_counted == 1, method
        assert float(res.scores[1, 2]) == 1.0 and float(res.scores[0, 1]) == 0.0, method


def test_the_knockout_workaround_cuts_edges_inside_generate(bridge):
    """What knockout's error suggests: a score hook inside generate changes the output; an empty cut does not."""
    def cut(keys):
        def hook(scores, hook):
            s = scores.clone()
            s[..., keys] = -torch.inf
            return s
        return hook

    prompt = _ids()[:1]
    clean = bridge.generate(prompt, seed=4, gen_length=8, steps=2)
    noop = bridge.generate(prompt, seed=4, gen_length=8, steps=2,
                           fwd_hooks=[(f"blocks.{l}.attn.hook_attn_scores", cut([])) for l in range(3)])
    cutp = bridge.generate(prompt, seed=4, gen_length=8, steps=2,     # every canvas row loses the whole prompt
                           fwd_hooks=[(f"blocks.{l}.attn.hook_attn_scores", cut(list(range(5)))) for l in range(3)])
    assert torch.equal(noop.tokens, clean.tokens)
    assert not torch.equal(cutp.tokens, clean.tokens)


def test_sequence_forward_checks_its_arguments(bridge):
    from mdm_lens import HookedMDM
    from mdm_lens.bridge.sequence import sequence_forward
    from mdm_lens.errors import ArgumentTypeError, OutOfRangeError

    tokens = torch.randint(2, 128, (2, 12), generator=torch.Generator().manual_seed(9))
    with pytest.raises(OutOfRangeError, match="layers"):
        sequence_forward(bridge, tokens, 7, layers=[3])
    with pytest.raises(ArgumentError, match="prompt_length"):
        sequence_forward(bridge, tokens, 12, layers=[0])
    with pytest.raises(ArgumentTypeError, match="tokens"):
        sequence_forward(bridge, tokens.float(), 7, layers=[0])
    with pytest.raises(ArgumentError, match="attention_mask"):
        sequence_forward(bridge, tokens, 7, attention_mask=torch.ones(2, 11), layers=[0])
    with pytest.raises(ArgumentError, match="block-diffusion"):
        sequence_forward(HookedMDM.from_pretrained("mdm-lens/tiny-mdm"), tokens, 7, layers=[0])
    with pytest.raises(InputError, match="d_model"):
        bridge.final_logits(torch.zeros(1, 2, 5))
    assert not any(h.fwd_hooks for h in bridge.hook_dict.values())
