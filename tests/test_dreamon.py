"""DreamOn's variable-length sampler: token-exact against the plain-torch transcription of the reference
(tests/dreamon_reference.py) on realistic random weights, planted expand / delete steps whose canvas, slot and
origin maps are known exactly, the trajectory / cache / reducer bookkeeping, and the refusals."""

from __future__ import annotations

import pytest
import torch

from mdm_lens import HookedMDM, MDMConfig
from mdm_lens.diffusion.varlen import require_fixed_length
from mdm_lens.errors import InputError, SamplerConfigError
from mdm_lens.hooks.reducers import ReceivedAttention
from mdm_lens.hooks.steps import at_steps
from mdm_lens.hooks.trajectory import TrajectoryCache
from tests.dreamon_reference import reference_expand_generate

MASK, EXP, EOS, PAD = 49, 48, 1, 0
PREFIX = torch.tensor([[3, 11, 5, 20, 6]])
SUFFIX = [7, 30, 8]


def dreamon_model(seed=2, boost=2.5, expand_boost=3.0):
    """A Dream layout (shifted logits, cumsum positions, pair padding mask, q/k/v biases) whose vocabulary has the
    expand token; expand and EOS boosted so that unplanted runs expand and delete too."""
    cfg = MDMConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_mlp=48, d_vocab=50, mask_token_id=MASK,
                    n_ctx=64, eos_token_id=EOS, pad_token_id=PAD, logit_shift=True, position_policy="cumsum",
                    padding_mask="pair", qkv_bias=True, extra={"expand_token_id": EXP})
    model = HookedMDM.from_config(cfg, seed=seed, init_std=0.3, init="realistic")
    with torch.no_grad():
        model.unembed.weight[EXP] *= expand_boost
        model.unembed.weight[EOS] *= boost
        model.unembed.weight[MASK] = 0  # a trained model never predicts the mask itself (the run would stall)
    return model


def _ref(model, **kw):
    inp = torch.cat([PREFIX, torch.full((1, kw["min_gen_len"]), MASK), torch.tensor([SUFFIX + [EOS]])], 1)
    return reference_expand_generate(model, inp, mask_id=MASK, expand_id=EXP, eos_id=EOS, **kw)


CASES = [  # steps, min, max, alg, alg_temp, temperature, top_p, top_k, delete_eos, pad_eos, seed
    (40, 3, 10, "entropy", 0.0, 0.1, 0.9, None, True, True, 0),  # the reference's eval settings
    (40, 4, 12, "entropy", 0.0, 0.0, None, None, True, True, 1),
    (30, 2, 9, "maskgit_plus", None, 0.7, 0.95, None, True, True, 2),
    (30, 3, 8, "topk_margin", 0.5, 1.0, None, 10, True, True, 3),
    (25, 4, 10, "entropy", 2.0, 0.5, 0.9, 20, False, True, 4),
    (25, 3, 10, "maskgit_plus", 0.0, 0.3, None, None, True, False, 5),
    (12, 5, 5, "entropy", 0.0, 0.1, 0.9, None, True, True, 6),  # no room: expand blocked from the start
]


@pytest.mark.parametrize("steps, lo, hi, alg, alg_temp, t, top_p, top_k, delete, pad, seed", CASES)
def test_dreamon_matches_the_reference_token_for_token(steps, lo, hi, alg, alg_temp, t, top_p, top_k, delete, pad,
                                                       seed):
    model = dreamon_model()
    kw = dict(steps=steps, min_gen_len=lo, max_gen_len=hi, alg=alg, alg_temp=alg_temp, temperature=t, top_p=top_p,
              top_k=top_k, delete_eos_token=delete, pad_eos_to_right=pad)
    out = model.generate(PREFIX, sampler="dreamon", suffix=SUFFIX, seed=seed, **kw)
    ref, n_gen = _ref(model, seed=seed, **kw)
    width = PREFIX.shape[1] + n_gen + len(SUFFIX) + 1
    assert out.answer_length == [n_gen]
    assert torch.equal(out.tokens, ref[:, :width])
    assert bool((ref[:, width:] == MASK).all())  # the reference's buffer tail is masks only


def test_the_exact_cases_exercise_expansions_and_deletions():
    """The cases above are not all fixed-length runs: between them the canvas grows and shrinks."""
    model = dreamon_model()
    how = torch.cat([model.generate(PREFIX, sampler="dreamon", suffix=SUFFIX, seed=c[-1], steps=c[0],
                                    min_gen_len=c[1], max_gen_len=c[2], alg=c[3], alg_temp=c[4], temperature=c[5],
                                    top_p=c[6], top_k=c[7], delete_eos_token=c[8], pad_eos_to_right=c[9]
                                    ).trajectory.length.removed_how.flatten() for c in CASES])
    assert int((how == 2).sum()) >= 8 and int((how == 1).sum()) >= 8


def _planted(model, plan):
    """A hook on ln_final's output writing, at the row that predicts the planted position, the direction of the
    planted token's unembedding (so its logit dominates). `plan[step] = (k, token)`: the k-th masked position of
    that step's canvas gets the token. Reads (step, masked) from `where()`."""
    def direction(token):
        return 400 * model.unembed.weight[token] / model.ln_final.w

    def make(where):
        def hook(resid, hook):
            step, masked = where()
            if step in plan:
                k, token = plan[step]
                p = int(masked[0].nonzero().flatten()[k])
                resid = resid.clone()
                resid[0, p - 1] = direction(token)  # shifted logits: position p reads row p - 1
            return resid
        return hook
    return make


def test_planted_expand_and_delete_move_the_canvas_exactly():
    model = dreamon_model(boost=1.0, expand_boost=1.0)
    # step 0: expand the 2nd span mask; step 1: expand the 1st; step 2: EOS at the last of the 5 masks, deleted
    # (the span shrinks by one); step 3: EOS at the 2nd of 4: the EOS fill turns the 3rd and 4th into EOS and all
    # three are deleted
    plan = {0: (1, EXP), 1: (0, EXP), 2: (4, EOS), 3: (1, EOS)}
    make = _planted(model, plan)
    hook = make(lambda: (model.state.step, model.state.masked))
    out = model.generate(PREFIX, sampler="dreamon", suffix=SUFFIX, steps=20, min_gen_len=3, max_gen_len=8,
                         temperature=0.0, top_p=None, fwd_hooks=[("ln_final.hook_normalized", hook)], seed=0)
    L, P = out.trajectory.length, PREFIX.shape[1]
    widths = L.widths.tolist()
    base = P + 3 + len(SUFFIX) + 1
    assert widths[:5] == [base, base + 1, base + 2, base + 1, base - 2]
    # slots: span masks are 5, 6, 7; slot 6 → 12, 13 at step 0; slot 5 → 14, 15 at step 1; step 2's 4th mask
    # (slot 7, the last) becomes EOS and is deleted
    assert L.slot_steps[1, 0, P:P + 4].tolist() == [5, 12, 13, 7]
    assert L.slot_steps[2, 0, P:P + 5].tolist() == [14, 15, 12, 13, 7]
    assert L.slot_steps[3, 0, P:P + 4].tolist() == [14, 15, 12, 13]
    assert L.origin_steps[2, 0, P:P + 5].tolist() == [-1, -1, -1, -1, 7]
    assert L.origin_steps[2, 0, :P].tolist() == list(range(P))
    assert (L.removed_how[0, 6], L.removed_step[0, 6]) == (2, 0)
    assert (L.removed_how[0, 5], L.removed_step[0, 5]) == (2, 1)
    assert (L.removed_how[0, 7], L.removed_step[0, 7]) == (1, 2)
    assert L.commit_token[0, 6] == EXP and L.commit_token[0, 7] == EOS
    assert L.slot_steps[4, 0, P:P + 1].tolist() == [14] and L.removed_step[0, [15, 12, 13]].tolist() == [3, 3, 3]
    assert torch.isnan(out.trajectory.length.commit_step[0, [12, 13]].float()).sum() == 0
    assert L.commit_step[0, [15, 12, 13]].tolist() == [3, 3, 3]  # the chosen row and the two EOS-filled ones
    # the reference, planted the same way, agrees token for token
    seen = {}
    ref_hook = make(lambda: (seen["step"], seen["masked"]))

    def wrapped(x, **kw):
        return model.run_with_hooks(x, fwd_hooks=[("ln_final.hook_normalized", ref_hook)], **kw)

    seen["step"] = -1

    def step_then_forward(x, attn_mask, position_ids):
        seen["step"] += 1
        seen["masked"] = (x == MASK) & attn_mask[:, 0].any(-2)
        return wrapped(x, attn_mask=attn_mask, position_ids=position_ids)
    ref, n_gen = _ref(step_then_forward, steps=20, min_gen_len=3, max_gen_len=8, temperature=0.0, top_p=None)
    assert torch.equal(out.tokens, ref[:, :P + n_gen + len(SUFFIX) + 1]) and out.answer_length == [n_gen]


def test_every_masked_slot_is_committed_once_and_the_books_balance():
    model = dreamon_model()
    out = model.generate(PREFIX, sampler="dreamon", suffix=SUFFIX, steps=40, min_gen_len=3, max_gen_len=10, seed=0)
    L, tr = out.trajectory.length, out.trajectory
    prompt = L.commit_step[0] == -1
    assert int(prompt.sum()) == PREFIX.shape[1] + len(SUFFIX) + 1
    assert bool((L.n_commits[0][~prompt] <= 1).all()) and bool((L.n_commits[0][prompt] == 0).all())
    removed = L.removed_how[0] > 0
    # a slot leaves only after it was committed (as expand or EOS), at that very step
    assert bool((L.commit_step[0][removed] == L.removed_step[0][removed]).all())
    assert bool((L.commit_token[0][L.removed_how[0] == 2] == EXP).all())
    assert bool((L.commit_token[0][L.removed_how[0] == 1] == EOS).all())
    # the run ended with no mask: every surviving span slot was committed once, to its final token
    final = L.final_slot[0]
    assert not bool((out.tokens == MASK).any())
    assert torch.equal(L.commit_token[0, final][~prompt[final]], out.tokens[0][~prompt[final]])
    assert int(tr.n_committed.sum()) == int(L.n_commits.sum())
    # the trajectory's commit_step indexes the final tokens
    assert torch.equal(tr.commit_step[0], L.commit_step[0, final])
    assert L.final_origin[0, :PREFIX.shape[1]].tolist() == list(range(PREFIX.shape[1]))
    # x_steps[s] is that step's canvas: its columns are the slots of slot_steps[s]
    for s in range(tr.n_steps):
        w = int(L.widths[s])
        assert bool((tr.x_steps[s, 0, w:] == -1).all()) and bool((tr.x_steps[s, 0, :w] >= 0).all())


def test_hooks_see_the_origin_map_and_records_and_cache_follow_it():
    model = dreamon_model()
    seen = {}

    def spy(t, hook):
        seen[model.state.step] = (model.state.origin.clone(), t.shape[1])

    cache = TrajectoryCache("blocks.0.hook_resid_post")
    out = model.generate(PREFIX, sampler="dreamon", suffix=SUFFIX, steps=40, min_gen_len=3, max_gen_len=10, seed=0,
                         fwd_hooks=[("blocks.1.hook_resid_post", spy)], record=[ReceivedAttention()], cache=cache)
    L = out.trajectory.length
    for s, (origin, rows) in seen.items():
        w = int(L.widths[s])
        assert rows == w and torch.equal(origin, L.origin_steps[s, :, :w])
        assert torch.equal(cache.origin_of(s), origin)
        assert cache[s]["blocks.0.hook_resid_post"].shape[1] == w
    meta = out.record_meta["received_attention"]["origin"]
    assert meta.shape[0] == out.n_steps and bool((meta[:, 0, :] == torch.where(
        L.slot_steps[:, 0] >= 0, L.origin_steps[:, 0], torch.full_like(L.origin_steps[:, 0], -2))).all())
    att = out.records["received_attention"]
    assert torch.allclose(att.nansum(-1), torch.ones_like(att.nansum(-1)), atol=1e-5)  # mass over the step's own keys
    assert bool(att[meta[:, :, None, None, :].expand_as(att) == -2].isnan().all())  # no slot there: no key
    with pytest.raises(InputError, match="inserted or deleted rows"):
        cache.stack("blocks.0.hook_resid_post", pad_value=0.0)
    with pytest.raises(InputError, match="inserted or deleted rows"):
        cache.stack("blocks.0.hook_resid_post", align=True)
    # steps between which nothing moved stack as usual
    same = [s for s in range(out.n_steps - 1) if torch.equal(L.slot_steps[s], L.slot_steps[s + 1])]
    assert same, "the run should have steps that neither expand nor delete"
    c2 = TrajectoryCache("blocks.0.hook_resid_post", steps=[same[0], same[0] + 1])
    out2 = model.generate(PREFIX, sampler="dreamon", suffix=SUFFIX, steps=40, min_gen_len=3, max_gen_len=10, seed=0,
                          cache=c2)
    assert c2.stack("blocks.0.hook_resid_post").shape[0] == 2
    assert torch.equal(out2.tokens, out.tokens)  # observation changes nothing


def test_replay_reproduces_the_logits_each_step_read():
    model = dreamon_model()
    got = {}

    def keep(t, hook):
        got[model.state.step] = t.clone()

    out = model.generate(PREFIX, sampler="dreamon", suffix=SUFFIX, steps=40, min_gen_len=3, max_gen_len=10, seed=0,
                         fwd_hooks=[("blocks.1.hook_resid_post", keep)])
    for s in (0, out.n_steps // 2, out.n_steps - 1):
        again = {}
        out.replay(model, s, fwd_hooks=[("blocks.1.hook_resid_post", lambda t, hook: again.setdefault(s, t))])
        assert torch.allclose(again[s], got[s], atol=1e-5, rtol=1e-5)
        assert torch.equal(out.state_at(s).origin, out.trajectory.length.origin_steps[s, :, :got[s].shape[1]])
    with pytest.raises(SamplerConfigError, match="inserted and deleted rows mid-run"):
        require_fixed_length(out, "probe X")


@pytest.mark.parametrize("kw, error, match", [
    (dict(prompt=torch.cat([PREFIX, PREFIX])), SamplerConfigError, "batch 1"),
    (dict(attention_mask=torch.tensor([[0, 1, 1, 1, 1]])), SamplerConfigError, "padding"),
    (dict(suffix=[7, MASK]), InputError, "mask token"),
    (dict(suffix=[EXP]), InputError, "expand token"),
    (dict(suffix=[1.5]), InputError, "integer"),
    (dict(suffix=[[1, 2], [3, 4]]), InputError, "1-D"),
    (dict(suffix=[99]), InputError, "outside"),
    (dict(min_gen_len=6, max_gen_len=4), SamplerConfigError, "max_gen_len"),
    (dict(alg="origin"), SamplerConfigError, "alg"),
    (dict(max_tokens=5), SamplerConfigError, "max_tokens"),
    (dict(max_gen_len=80), SamplerConfigError, "may grow to 89, within the model.s 64"),
    (dict(cache="blocks.0.hook_resid_post" @ __import__("mdm_lens").steps(-1)), SamplerConfigError, "from the end"),
])
def test_refusals_name_the_argument(kw, error, match):
    model = dreamon_model()
    args = dict(prompt=PREFIX, suffix=SUFFIX, steps=4, max_gen_len=10)
    args.update(kw)
    with pytest.raises(error, match=match):
        model.generate(args.pop("prompt"), sampler="dreamon", **args)


def test_a_model_without_the_expand_token_or_of_another_family_is_refused():
    model = dreamon_model()
    del model.cfg.extra["expand_token_id"]
    with pytest.raises(SamplerConfigError, match="expand token"):
        model.generate(PREFIX, sampler="dreamon", suffix=SUFFIX, steps=4)
    cfg = MDMConfig(d_model=32, n_layers=1, n_heads=4, d_mlp=48, d_vocab=50, mask_token_id=MASK, n_ctx=64,
                    eos_token_id=EOS, extra={"expand_token_id": EXP})
    llada = HookedMDM.from_config(cfg, seed=0, init_std=0.3, init="realistic")
    with pytest.raises(SamplerConfigError, match="Dream-family"):
        llada.generate(PREFIX, sampler="dreamon", suffix=SUFFIX, steps=4)


def test_probes_refuse_a_variable_length_run_with_a_typed_error():
    from mdm_lens.lens import trace  # noqa: F401
    from mdm_lens.probes._runtools import step_canvas

    model = dreamon_model()
    out = model.generate(PREFIX, sampler="dreamon", suffix=SUFFIX, steps=40, min_gen_len=3, max_gen_len=10, seed=0)
    with pytest.raises(SamplerConfigError, match="did not exist at a step") as info:
        step_canvas(out, 0)
    assert info.value.argument == "out"
    with pytest.raises(SamplerConfigError, match="lens_trace.*'dreamon' run"):
        trace._check_run(model, out)
    model.generate(PREFIX, steps=4, gen_length=4)  # the fixed-length Dream sampler is untouched
