"""Retrieval scores on planted copy heads (spec §3.7).

How the rig works (hooks, not trained weights, so the known answer is exact):
- *copy*: a hook on ``blocks.{l}.attn.hook_pattern`` replaces head h's rows at the chosen query rows
  with a one-hot on a chosen key, so ``argmax_j A_{q, j}`` is that key;
- *emit*: the unembedding row of the token to emit is scaled ×100 and a hook on
  ``ln_final.hook_normalized`` writes that row's direction at the readout rows, so the sampler emits
  exactly that token there.
A copy head then scores 1.0 iff the rows it was rigged at are the rows the score reads (q(p) = p, or
p − 1 for shifted models / ARMs) and the rigged key holds the emitted token inside the needle.
"""

import pytest
import torch

from mdm_lens import HookedMDM, MDMConfig
from mdm_lens.errors import ArgumentError
from mdm_lens.probes import retrieval as RT

P = 10                         # prompt length
NEEDLE, OTHER = 4, 7           # needle position, a distractor position


def tiny(causal=False, shift=False, seed=0, init="realistic"):
    cfg = MDMConfig(d_model=32, n_layers=2, n_heads=4, d_mlp=64, d_vocab=40, n_ctx=64, mask_token_id=3,
                    bos_token_id=1, eos_token_id=2, pad_token_id=0, logit_shift=shift,
                    attention="causal" if causal else "bidirectional")
    return HookedMDM.from_config(cfg, seed=seed, init_std=0.2, init=init)


def prompt(seed=0):
    return torch.randperm(35, generator=torch.Generator().manual_seed(seed))[:P] + 5   # distinct tokens


def copy_hook(layer, head, rows, key, when=None):
    """Head (layer, head) puts all its mass on ``key`` at the query rows ``rows(T)``."""
    def hook(pattern, hook, model=None):
        if when is not None and not when():
            return None
        T = pattern.shape[-1]
        p = pattern.clone()
        for r in rows(T):
            p[:, head, r] = 0
            p[:, head, r, key] = 1
        return p
    return (f"blocks.{layer}.attn.hook_pattern", hook)


def emit_hooks(model, emits):
    """``emits(T) -> {row: token}``: force the logits of those rows to pick the token."""
    W = model.unembed.weight
    with torch.no_grad():
        for tok in {t for t in emits(64).values()}:
            W[tok] *= 100

    def hook(x, hook):
        y = x.clone()
        for r, tok in emits(x.shape[1]).items():
            y[:, r] = W[tok] / W[tok].norm() * x.shape[-1] ** 0.5
        return y
    return ("ln_final.hook_normalized", hook)


def item(p, answer, gold_doc=None):
    return RT.RetrievalItem(p, [(NEEDLE, NEEDLE + 1)], answer, gold_doc)


# ---------------------------------------------------------------------------------------------- planted heads

@pytest.mark.parametrize("method", ["copy@commit", "copy@any", "copy@final"])
def test_copy_head_scores_one_and_a_non_copy_head_zero(method):
    model, p = tiny(), prompt()
    w = int(p[NEEDLE])
    hooks = [copy_hook(1, 2, lambda T: [P], NEEDLE), copy_hook(0, 1, lambda T: [P], OTHER),
             emit_hooks(model, lambda T: {P: w})]
    res = RT.retrieval_scores(model, [item(p, [w])], method=method, gen_length=1, fwd_hooks=hooks)
    assert res.n_counted == 1 and res.correct.tolist() == [True]
    assert float(res.scores[1, 2]) == 1.0
    assert float(res.scores[0, 1]) == 0.0
    assert (1, 2) in res.retrieval_heads and (0, 1) not in res.above_threshold
    df = res.to_frame()
    assert len(df) == 8 and bool(df.query("layer == 1 and head == 2").retrieval.iloc[0])


def test_token_identity_is_required_but_evidence_focus_ignores_it():
    model, p = tiny(), prompt()
    other = int(p[OTHER])                                                  # emitted ≠ token at the needle
    hooks = [copy_hook(1, 2, lambda T: [P], NEEDLE), emit_hooks(model, lambda T: {P: other})]
    it = item(p, [other], gold_doc=(3, 6))
    copy = RT.retrieval_scores(model, [it], gen_length=1, fwd_hooks=hooks)
    focus = RT.retrieval_scores(model, [it], method="evidence_focus", gen_length=1, fwd_hooks=hooks)
    assert copy.n_counted == 1 and float(copy.scores[1, 2]) == 0.0
    assert float(focus.scores[1, 2]) == 1.0
    assert focus.retrieval_heads == [] and (1, 2) in focus.above_threshold


def test_only_correct_samples_are_counted():
    model, p = tiny(), prompt()
    w = int(p[NEEDLE])
    hooks = [copy_hook(1, 2, lambda T: [P], NEEDLE), emit_hooks(model, lambda T: {P: w})]
    wrong = item(p, [int(p[0])])
    res = RT.retrieval_scores(model, [wrong], gen_length=1, fwd_hooks=hooks)
    assert res.n_counted == 0 and torch.isnan(res.scores).all() and res.retrieval_heads == []
    lax = RT.retrieval_scores(model, [wrong], gen_length=1, fwd_hooks=hooks, only_correct=False)
    assert lax.n_counted == 1 and float(lax.scores[1, 2]) == 1.0


@pytest.mark.parametrize("shift", [False, True], ids=["llada", "dream"])
@pytest.mark.parametrize("rigged_row", [P, P - 1])
def test_copy_at_commit_reads_p_minus_1_for_shifted_models(shift, rigged_row):
    model, p = tiny(shift=shift), prompt()
    w = int(p[NEEDLE])
    readout = P - int(shift)                                               # the row whose logits emit position P
    hooks = [copy_hook(1, 2, lambda T: [rigged_row], NEEDLE), emit_hooks(model, lambda T: {readout: w})]
    res = RT.retrieval_scores(model, [item(p, [w])], gen_length=1, fwd_hooks=hooks)
    assert res.n_counted == 1
    assert float(res.scores[1, 2]) == (1.0 if rigged_row == readout else 0.0)


def test_arm_wu_equals_copy_at_commit_with_the_query_at_p_minus_1():
    model, p = tiny(causal=True), prompt()
    w = int(p[NEEDLE])
    rows = lambda T: range(P - 1, T)                                       # noqa: E731  emitting rows only
    hooks = [copy_hook(1, 2, rows, NEEDLE), emit_hooks(model, lambda T: {r: w for r in rows(T)})]
    it = item(p, [w])
    res = {m: RT.retrieval_scores(model, [it], method=m, gen_length=2, fwd_hooks=hooks)
           for m in ("wu", "copy@commit", "copy@final")}
    for r in res.values():
        assert r.n_counted == 1 and float(r.scores[1, 2]) == 1.0
    assert torch.equal(res["wu"].scores, res["copy@commit"].scores)
    with pytest.raises(ValueError):
        RT.retrieval_scores(tiny(), [it], method="wu")


def test_copy_any_sees_events_before_the_commit_step():
    model, p = tiny(), prompt()
    j2 = NEEDLE + 1
    w1, w2 = int(p[NEEDLE]), int(p[j2])
    step0 = lambda: model.state is not None and model.state.step == 0     # noqa: E731
    hooks = [copy_hook(1, 2, lambda T: [P], NEEDLE, when=step0), copy_hook(1, 2, lambda T: [P + 1], j2, when=step0),
             emit_hooks(model, lambda T: {P: w1, P + 1: w2})]
    it = RT.RetrievalItem(p, [(NEEDLE, j2 + 1)], [w1, w2])
    commit = RT.retrieval_scores(model, [it], gen_length=2, steps=2, fwd_hooks=hooks)
    anyy = RT.retrieval_scores(model, [it], method="copy@any", gen_length=2, steps=2, fwd_hooks=hooks)
    assert float(commit.scores[1, 2]) == 0.5                               # one of two committed at step 0
    assert float(anyy.scores[1, 2]) == 1.0


def test_from_qa_item_locates_the_needle():
    from mdm_lens.zoo import data as D
    from mdm_lens.zoo import tokenizer as ZT

    qa = D.make_dataset(3, seed=1, n_distractors=3)
    for q in qa:
        it = RT.from_qa_item(q, ZT.load_tokenizer())
        (s, e), = it.evidence
        assert it.prompt_ids[s:e].tolist() == ZT.encode(q.answer)
        assert it.gold_doc[0] <= s < e <= it.gold_doc[1]
        assert ZT.decode(it.prompt_ids[it.gold_doc[0]:it.gold_doc[1]].tolist()).endswith(q.passages[q.gold_index])
    assert RT.answer_correct(None, ZT.encode(qa[0].answer + " <eos> <eos>"), qa[0].answer, decode=ZT.decode)
    assert not RT.answer_correct(None, ZT.encode("red"), "blue", decode=ZT.decode)
    with pytest.raises(ArgumentError, match="tokenizer"):                 # text needs the model's tokenizer
        RT.from_qa_item(qa[0])


# ---------------------------------------------------------------------------------------------- head masking

def _no_hooks(model):
    return all(not hp.fwd_hooks for hp in model.hook_dict.values())


def test_mask_heads_zero_and_uniform_are_removed_afterwards():
    model, t = tiny(), prompt()[None]
    clean = model(t)
    with RT.mask_heads(model, [(0, 1), (1, 3)]):
        _, cache = model.run_with_cache(t, names_filter=lambda n: n.endswith("hook_z"))
        assert cache["blocks.0.attn.hook_z"][:, :, 1].abs().max() == 0
        assert cache["blocks.1.attn.hook_z"][:, :, 3].abs().max() == 0
        assert cache["blocks.0.attn.hook_z"][:, :, 0].abs().max() > 0
    assert _no_hooks(model) and torch.equal(model(t), clean)
    with RT.mask_heads(model, [(1, 2)], method="uniform"):
        _, cache = model.run_with_cache(t, names_filter="blocks.1.attn.hook_pattern")
    pat = cache["blocks.1.attn.hook_pattern"][0, 2]
    assert torch.allclose(pat, torch.full_like(pat, 1 / P))
    assert _no_hooks(model)


def test_ablation_of_the_planted_head_hurts_and_random_heads_do_not():
    """Planted causal dependency: the answer is emitted only while head (1, 2) writes to the residual."""
    model = tiny(init="normal")  # the answer is planted at ln_final.hook_normalized, before ln_final.w: unit norms
    model.set_use_attn_result(True)
    flag = {}

    def watch(result, hook):
        flag["on"] = bool(result[:, :, 2].abs().sum() > 0)

    W = model.unembed.weight
    items = [item(p, [int(p[NEEDLE])]) for p in (prompt(s) for s in range(3))]
    for it in items:
        with torch.no_grad():
            W[it.answer[0]] *= 100

    def emit(x, hook):
        if not flag.get("on") or model.state is None:
            return None
        tok = int(model.state.x[0, NEEDLE])
        y = x.clone()
        y[:, P] = W[tok] / W[tok].norm() * x.shape[-1] ** 0.5
        return y

    with model.hooks(fwd_hooks=[("blocks.1.attn.hook_result", watch), ("ln_final.hook_normalized", emit)]):
        res = RT.ablation_accuracy(model, items, [(1, 2), (0, 0)], k=1, n_random=3, seed=0, gen_length=1)
    assert res.accuracy_clean == 1.0 and res.accuracy_top == 0.0
    assert res.accuracy_random == [1.0, 1.0, 1.0] and all((1, 2) not in d for d in res.random_heads)
    assert res.drop_top == 1.0 and res.drop_random == 0.0
    assert list(res.to_frame().condition) == ["clean", "top", "random", "random", "random"]
    assert _no_hooks(model)
