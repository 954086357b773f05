"""Every sampler option on a rigged model whose logits are designed so each algorithm commits a known, different
order (issue 15). Positions 5..9 carry five distributions (prompt length 5):

    pos  name  p1    p2     margin  neg. entropy   top-2 renormalised p1
    5    V     .70   .0061  .694    -1.778         .991
    6    X     .60   .05    .550    -2.179         .923
    7    Y     .95   .0010  .949    -0.393         .999
    8    U     .55   .45    .100    -0.688         .550
    9    W     .80   .19    .610    -0.579         .808

so maskgit/low-confidence ranks Y W V X U, topk_margin Y V W X U, entropy Y W U V X, and maskgit under top_k=2
ranks Y V X W U. Dream's schedule for 5 masks in 4 steps is [1, 1, 1, 2] (the last step takes the last two).
"""

from __future__ import annotations

import pytest
import torch

from mdm_lens.diffusion.schedules import dream_timesteps
from sampler_rigs import EOS, EOT, MASK, V, rig, rigged, spread, static

P = 5
PROMPT = torch.tensor([[5, 6, 7, 8, 9]])
ROWS = {5: spread({12: .70}), 6: spread({15: .60, 16: .05}), 7: spread({17: .95}),
        8: spread({10: .55, 11: .45 - 1e-6}), 9: spread({13: .80, 14: .19})}
ARGMAX = [12, 15, 17, 10, 13]
NEG_ENTROPY = torch.tensor([-1.7784, -2.1786, -0.3931, -0.6882, -0.5788])


def commit_steps(out):
    return out.trajectory.commit_step[0, P:].tolist()


def dream(alg, **kw):
    model = rigged("dream")
    kw = dict(dict(temperature=0, top_k=None, top_p=None), **kw)
    return model.generate(PROMPT, steps=4, gen_length=5, alg=alg, fwd_hooks=[rig(model, static(ROWS))], **kw)


# --- Dream: the four algorithms ----------------------------------------------------------------------

DREAM_EXPECTED = {"maskgit_plus": [2, 3, 0, 3, 1], "topk_margin": [1, 3, 0, 3, 2], "entropy": [3, 3, 0, 2, 1]}


@pytest.mark.parametrize("alg", sorted(DREAM_EXPECTED))
def test_dream_confidence_algorithms_commit_the_designed_order(alg):
    out = dream(alg)
    assert commit_steps(out) == DREAM_EXPECTED[alg]
    assert out.generated[0].tolist() == ARGMAX


def _origin_expected(seed, n_steps=4, n=5, eps=1e-3):
    """Origin unmasks each still-masked position w.p. 1 - s/t (1 at the last step), one uniform draw per masked
    position (in position order) from the seeded generator; at temperature 0 nothing else draws."""
    g = torch.Generator().manual_seed(seed)
    ts = dream_timesteps(n_steps, eps)
    left, out = list(range(n)), [None] * n
    for i in range(n_steps):
        p = 1 - ts[i + 1] / ts[i] if i < n_steps - 1 else 1
        chosen = torch.rand(len(left), generator=g) < p
        for j, c in zip(list(left), chosen.tolist()):
            if c:
                out[j] = i
                left.remove(j)
    return out


def test_dream_origin_commits_by_its_transfer_probability_and_differs_from_the_others():
    orders = {}
    for seed in (0, 1, 2):
        out = dream("origin", seed=seed)
        expected = _origin_expected(seed)
        assert commit_steps(out) == expected and out.generated[0].tolist() == ARGMAX
        orders[seed] = expected
    assert orders[0] == [2, 3, 0, 0, 2]  # the planted draws of seed 0 (a sanity pin on the helper itself)
    for order in orders.values():
        assert order not in DREAM_EXPECTED.values()
    # the four algorithms: four different orders
    all_four = [tuple(orders[0])] + [tuple(v) for v in DREAM_EXPECTED.values()]
    assert len(set(all_four)) == 4


def test_dream_alg_temp_samples_positions_by_softmax_of_confidence():
    out = dream("entropy", alg_temp=0.5, seed=3)
    g = torch.Generator().manual_seed(3)
    conf = NEG_ENTROPY.clone()
    left, expected = list(range(5)), [None] * 5
    for i, k in enumerate([1, 1, 1, 2]):
        weights = torch.softmax(conf[left] / 0.5, dim=-1)
        # the sampler draws over the whole row (prompt and committed positions have weight 0)
        full = torch.zeros(P + 5)
        full[[P + j for j in left]] = weights
        picked = torch.multinomial(full, k, generator=g).tolist()
        for q in picked:
            expected[q - P] = i
            left.remove(q - P)
    assert commit_steps(out) == expected
    assert expected != DREAM_EXPECTED["entropy"]  # the planted seed draws a different order than top-k would


def test_dream_top_k_filters_before_the_confidence():
    # top_k keeps every token tied with the k-th logit (as the reference): V's 49 equal runners-up all survive,
    # so V keeps p1 = .70 while X (.923), W (.808) and Y (.999) are renormalised over their top two
    assert commit_steps(dream("maskgit_plus", top_k=2)) == [3, 1, 0, 3, 2]


def test_dream_top_p_and_top_k_filter_as_the_reference():
    from mdm_lens.diffusion.dream import top_k_logits, top_p_logits

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).log_softmax(-1)
    p = logits.softmax(-1)[0]  # .644 .237 .087 .032
    low = torch.finfo(torch.float32).min
    # top-p keeps the smallest prefix whose mass reaches p, including the token that crosses it
    assert (top_p_logits(logits, 0.5)[0] == low).tolist() == [False, True, True, True]
    assert (top_p_logits(logits, float(p[0] + p[1]) - 1e-4)[0] == low).tolist() == [False, False, True, True]
    assert (top_p_logits(logits, 0.95)[0] == low).tolist() == [False, False, False, True]
    assert (top_k_logits(logits, 2)[0] == low).tolist() == [False, False, True, True]
    assert torch.equal(top_k_logits(logits, 10), logits)


def test_dream_temperature_with_top_p_is_seeded_and_filtered():
    """At temperature 1 a top-p of 0.5 leaves only each row's top token: the draw cannot leave it."""
    a = dream("maskgit_plus", temperature=1.0, top_p=0.5, seed=1)
    assert a.generated[0].tolist() == ARGMAX
    free = [dream("maskgit_plus", temperature=1.0, seed=s).generated[0].tolist() for s in range(4)]
    assert any(f != ARGMAX for f in free)


def test_dream_default_is_the_reference_legacy_generation_defaults():
    """Unset: temperature 1.0, top_p 1.0, top_k 50, as diffusion_generate runs without a generation_config. On a
    64-token vocabulary with nearly flat logits, the top-50 filter means tokens 50..63 are never drawn."""
    model = rigged("dream", vocab=64, mask=63)
    flat = {p: -0.01 * torch.arange(64.0) for p in range(P, P + 10)}
    hooks = [rig(model, static(flat, vocab=64))]
    outs = [model.generate(PROMPT, steps=5, gen_length=10, fwd_hooks=hooks, seed=s) for s in range(3)]
    assert outs[0].settings["temperature"] == 1.0 and outs[0].settings["top_k"] == 50
    assert outs[0].settings["top_p"] == 1.0 and outs[0].settings["alg"] == "origin"
    assert all(int(o.generated.max()) < 50 for o in outs)
    assert len({tuple(o.generated[0].tolist()) for o in outs}) > 1  # it samples
    off = [model.generate(PROMPT, steps=5, gen_length=10, fwd_hooks=hooks, seed=s, top_k=None) for s in range(3)]
    assert off[0].settings["top_k"] is None and any(int(o.generated.max()) >= 50 for o in off)


# --- LLaDA --------------------------------------------------------------------------------------------

def llada(rows=ROWS, gen=5, **kw):
    model = rigged("llada", eot_token_id=EOT)
    return model.generate(PROMPT, steps=kw.pop("steps", gen), gen_length=gen,
                          fwd_hooks=[rig(model, kw.pop("designed", static(rows)))], **kw)


def test_llada_low_confidence_commits_by_top1_probability():
    out = llada()
    assert commit_steps(out) == [2, 3, 0, 4, 1] and out.generated[0].tolist() == ARGMAX


def test_llada_random_remasking_commits_by_the_seeded_uniform_draws():
    out = llada(remasking="random", seed=4)
    g = torch.Generator().manual_seed(4)
    left, expected = list(range(5)), [None] * 5
    for i in range(5):
        u = torch.rand(1, P + 5, generator=g)[0, P:]
        j = max(left, key=lambda q: float(u[q]))
        expected[j] = i
        left.remove(j)
    assert commit_steps(out) == expected and expected != [2, 3, 0, 4, 1]


def test_llada_blocks_finish_the_left_block_first():
    p1 = [.6, .9, .7, .95, .5, .8]
    rows = {P + i: spread({20 + i: q}) for i, q in enumerate(p1)}
    assert commit_steps(llada(rows, gen=6)) == [4, 1, 3, 0, 5, 2]
    assert commit_steps(llada(rows, gen=6, block_length=3)) == [2, 0, 1, 3, 5, 4]


def _cfg_rows(state):
    """Cond: every canvas position has top logit 2 on token 20 + p; uncond: top logit u_p on the same token,
    u = [0, 1.5, .5, 2, 1]. Guided 2c - u ranks by -u; the reversed direction 2u - c by +u."""
    b, t = state.x.shape
    out = torch.zeros(b, t, V)
    u = [0, 1.5, .5, 2, 1]
    for i in range(5):
        out[:, P + i, 20 + i] = 2.0 if state.phase == "cond" else u[i]
    return out


def test_llada_cfg_guides_away_from_the_unconditional_logits():
    out = llada(designed=_cfg_rows, cfg_scale=1.0)
    assert commit_steps(out) == [0, 3, 1, 4, 2]  # ascending u; the reversed direction would give [4, 1, 3, 0, 2]


def _eos_rows(state):
    """Peaked rows (all other logits -1e4): pos 5 EOS (9) over tokens 12 (0.5) and 16 (0); pos 6 EoT (8.5); pos 7
    token 10 (8); pos 8 token 11 (7.5), each over a runner-up at 0. Confidences .99988 > .99980 > .99966 > .99945;
    without EOS, pos 5's best is token 12 at e^.5 / (e^.5 + 1) = .62."""
    b, t = state.x.shape
    out = torch.full((b, t, V), -1e4)
    for pos, (tok, logit, runner_up) in {5: (EOS, 9.0, 12), 6: (EOT, 8.5, 13), 7: (10, 8.0, 14),
                                         8: (11, 7.5, 15)}.items():
        out[:, pos, tok], out[:, pos, runner_up] = logit, 0.0
    out[:, 5, 12], out[:, 5, 16] = 0.5, 0.0
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_llada_eos_eot_confidence_suppression_depends_on_temperature(temperature):
    kw = dict(designed=_eos_rows, gen=4, steps=2, temperature=temperature, seed=0)
    plain = llada(**kw)
    assert commit_steps(plain) == [0, 0, 1, 1] and plain.generated[0].tolist() == [EOS, EOT, 10, 11]
    out = llada(**kw, confidence_eos_eot_inf=True)
    assert out.generated[0].tolist() == [EOS, EOT, 10, 11]  # the sampled tokens are unchanged
    # temperature 0: the noised logits are the logits, so EOS and EoT both lose their confidence;
    # temperature > 0: the EOS write lands in the noise copy, only EoT's confidence drops
    assert commit_steps(out) == ([1, 1, 0, 0] if temperature == 0 else [0, 1, 0, 1])


def test_llada_logits_eos_inf_forbids_eos():
    out = llada(designed=_eos_rows, gen=4, steps=4, logits_eos_inf=True)
    assert out.generated[0].tolist() == [12, EOT, 10, 11]
    assert commit_steps(out) == [3, 0, 1, 2]  # token 12 at pos 5 has probability .62, the lowest


# --- ARM ----------------------------------------------------------------------------------------------

def _arm_rows(state):
    """At step s (query position q = P + s - 1): token 20 + s with logit 8, EOS second (7); row 1 emits EOS at
    step 1."""
    b, t = state.x.shape
    out = torch.zeros(b, t, V)
    q = t - 1
    out[:, q, 20 + (q - P + 1)] = 8.0  # q - P + 1 = s
    out[:, q, EOS] = 7.0
    if b > 1 and q == P:
        out[1, q, EOS] = 9.0
    return out


def test_arm_decodes_the_designed_tokens_left_to_right_and_stops_at_eos():
    model = rigged("arm")
    two = PROMPT.repeat(2, 1)
    out = model.generate(two, gen_length=4, fwd_hooks=[rig(model, _arm_rows)])
    assert out.generated.tolist() == [[20, 21, 22, 23], [20, EOS, 22, 23]]
    assert out.trajectory.commit_step[0, P:].tolist() == [0, 1, 2, 3]
    stop = model.generate(two, gen_length=4, stop_at_eos=True, fwd_hooks=[rig(model, _arm_rows)])
    assert stop.generated.tolist() == [[20, 21, 22, 23], [20, EOS, EOS, EOS]]  # done rows keep emitting EOS
    one = model.generate(PROMPT, gen_length=4, stop_at_eos=True, fwd_hooks=[rig(model, _arm_rows)])
    assert one.generated.tolist() == [[20, 21, 22, 23]]


def test_arm_top_k_one_is_greedy_at_any_temperature():
    model = rigged("arm")
    hooks = [rig(model, _arm_rows)]
    greedy = [model.generate(PROMPT, gen_length=4, temperature=5.0, top_k=1, seed=s, fwd_hooks=hooks).generated
              for s in range(3)]
    assert all(g[0].tolist() == [20, 21, 22, 23] for g in greedy)
    hot = [model.generate(PROMPT, gen_length=4, temperature=5.0, seed=s, fwd_hooks=hooks).generated[0].tolist()
           for s in range(3)]
    assert any(h != [20, 21, 22, 23] for h in hot)


# --- step hooks: phase filtering ------------------------------------------------------------------------

def test_step_hooks_fire_only_in_their_cfg_phase():
    from mdm_lens import ReceivedAttention, at_steps, steps

    model = rigged("llada")
    seen = {"cond": [], "uncond": [], "both": []}

    def spy(key):
        return lambda x, hook: seen[key].append((model.state.step, model.state.phase))

    out = model.generate(PROMPT, steps=3, gen_length=3, cfg_scale=0.5, record=[ReceivedAttention()],
                         fwd_hooks=[("hook_embed", spy("cond")),
                                    at_steps(spy("uncond"), steps(phases=("uncond",)), name="hook_embed"),
                                    at_steps(spy("both"), steps(phases=("cond", "uncond")), name="hook_embed")])
    assert seen["cond"] == [(0, "cond"), (1, "cond"), (2, "cond")]
    assert seen["uncond"] == [(0, "uncond"), (1, "uncond"), (2, "uncond")]
    assert len(seen["both"]) == 6
    assert out.records["received_attention"].shape[0] == 3  # reducers see the conditional pass only
