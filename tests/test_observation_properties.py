"""Property tests of the observation surface (issue 21 §1, §3): recorders, caches, step selectors and generate's
observation arguments given out-of-range / empty / NaN / wrong-type values raise a typed `MDMLensError` or return
the documented result; every sampler commits each masked position exactly once and follows its schedule; a hook
that breaks the logits or returns the wrong shape stops the run with a typed error naming where."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mdm_lens import HookedMDM, KeyValueNorms, MDMConfig, ReceivedAttention, TopKKeys, TrajectoryCache, at_steps, steps
from mdm_lens import validate
from mdm_lens.diffusion.schedules import dream_schedule, llada_transfer_counts
from mdm_lens.errors import ArgumentTypeError, InputError, MDMLensError, NonFiniteError, SamplerConfigError

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
MASK = 49


def _model(kind: str, n_layers: int = 3) -> HookedMDM:
    cfg = MDMConfig(d_model=32, n_layers=n_layers, n_heads=2, n_kv_heads=2, d_mlp=32, d_vocab=50, mask_token_id=MASK,
                    attention="causal" if kind == "arm" else "bidirectional", logit_shift=kind == "dream", n_ctx=32,
                    eos_token_id=1)
    return HookedMDM.from_config(cfg, seed=0, init_std=0.3)


@pytest.fixture(scope="module")
def llada():
    return _model("llada")


@pytest.fixture(scope="module")
def dream():
    return _model("dream", n_layers=1)


@pytest.fixture(scope="module")
def arm():
    return _model("arm", n_layers=1)


def _random_logits(model, seed: int):
    """A rig (tests/sampler_rigs.py) writing seeded random logits that never favour the mask token: a sampler that
    samples the mask id itself (a random model can) re-masks the position, which no schedule accounts for."""
    from sampler_rigs import rig

    def designed(state):
        g = torch.Generator().manual_seed(1000 * seed + 10 * state.step + (state.phase == "uncond"))
        logits = 3 * torch.randn(*state.x.shape, model.cfg.d_vocab, generator=g)
        logits[..., MASK] = -30.0
        return logits

    return rig(model, designed)


@pytest.fixture(scope="module")
def rigs():
    from sampler_rigs import rigged

    return {kind: rigged(kind) for kind in ("llada", "dream", "arm")}


def _prompt(batch: int, length: int, pad: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 40, (batch, length), generator=torch.Generator().manual_seed(seed))
    am = torch.ones_like(ids)
    if batch > 1 and pad:
        am[1, :pad] = 0
    return ids, am


def _states(model):
    seen = {}

    def spy(x, hook):
        s = model.state
        if s.phase == "cond":
            seen[s.step] = s.masked.clone()

    return seen, ("hook_embed", spy)


def _check_commits(out, seen, schedule=None):
    """Each generated position committed exactly once; n_committed and state.masked agree with commit_step."""
    t, P = out.trajectory, out.prompt_length
    cs = t.commit_step
    assert (cs[:, :P] == -1).all()
    assert ((cs[:, P:] >= 0) & (cs[:, P:] < t.n_steps)).all()  # every generated position, exactly one step
    for s in range(t.n_steps):
        assert torch.equal(t.n_committed[s], (cs == s).sum(-1))
        if schedule is not None:
            assert t.n_committed[s].tolist() == schedule[s]
        if s in seen and seen[s].shape == cs.shape:  # masked before step s <=> committed at s or later
            assert torch.equal(seen[s][:, P:], cs[:, P:] >= s)
    assert int(t.n_committed.sum()) == cs.shape[0] * (cs.shape[1] - P)


# --- every sampler commits each masked position once, on its schedule ------------------------------------------
@SETTINGS
@given(gen=st.sampled_from([4, 6, 8]), blocks=st.sampled_from([1, 2]), per_block=st.integers(1, 5),
       temperature=st.sampled_from([0.0, 1.0]), remasking=st.sampled_from(["low_confidence", "random"]),
       cfg=st.sampled_from([0.0, 1.5]), batch=st.integers(1, 2), seed=st.integers(0, 50))
def test_llada_commits_each_position_once_on_its_schedule(rigs, gen, blocks, per_block, temperature, remasking, cfg,
                                                          batch, seed):
    model = rigs["llada"]
    if gen % blocks:
        blocks = 1
    n_steps = blocks * per_block
    ids, am = _prompt(batch, 3, 1, seed)
    seen, spy = _states(model)
    with _no_fail():
        out = model.generate(ids, attention_mask=am, steps=n_steps, gen_length=gen, block_length=gen // blocks,
                             temperature=temperature, remasking=remasking, cfg_scale=cfg, seed=seed,
                             fwd_hooks=[spy, _random_logits(model, seed)])
    per = llada_transfer_counts(torch.ones(batch, gen // blocks, dtype=torch.bool), per_block).T.tolist() * blocks
    _check_commits(out, seen, per)
    assert not (out.generated == MASK).any()


@SETTINGS
@given(gen=st.integers(2, 8), n_steps=st.integers(1, 8), alg=st.sampled_from(["maskgit_plus", "topk_margin", "entropy",
                                                                                "origin"]),
       batch=st.integers(1, 2), seed=st.integers(0, 50))
def test_dream_commits_each_position_once_on_its_schedule(rigs, gen, n_steps, alg, batch, seed):
    model = rigs["dream"]
    ids, am = _prompt(batch, 3, 0, seed)
    seen, spy = _states(model)
    with _no_fail():
        out = model.generate(ids, attention_mask=am, steps=n_steps, gen_length=gen, alg=alg, seed=seed,
                             fwd_hooks=[spy, _random_logits(model, seed)])
    schedule = None if alg == "origin" else [[c] * batch for c in dream_schedule(gen, n_steps)]
    _check_commits(out, seen, schedule)


@SETTINGS
@given(gen=st.integers(1, 8), batch=st.integers(1, 2), seed=st.integers(0, 50))
def test_arm_commits_one_position_per_step_in_order(rigs, gen, batch, seed):
    model = rigs["arm"]
    ids, am = _prompt(batch, 3, 1, seed)
    out = model.generate(ids, attention_mask=am, gen_length=gen, seed=seed, fwd_hooks=[_random_logits(model, seed)])
    _check_commits(out, {}, [[1] * batch for _ in range(gen)])
    assert torch.equal(out.trajectory.commit_step[0, 3:], torch.arange(gen))


class _no_fail:  # idle-step warnings are expected for steps > gen_length
    def __enter__(self):
        import warnings

        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.simplefilter("ignore")

    def __exit__(self, *exc):
        return self._w.__exit__(*exc)


# --- index-like arguments of recorders ---------------------------------------------------------------------------
JUNK = st.one_of(st.integers(-8, 8), st.floats(allow_nan=True), st.booleans(), st.text(max_size=2), st.none())
LAYER_ARGS = st.one_of(st.none(), st.integers(-6, 6), st.lists(st.integers(-6, 6), max_size=4),
                       st.lists(JUNK, max_size=3), st.floats(allow_nan=True), st.text(max_size=3))


def _expected_layers(layers, n):
    """The documented result: None = all; ints in [-n, n) counted from the end; distinct; at least one."""
    if layers is None:
        return list(range(n))
    items = [layers] if isinstance(layers, int) and not isinstance(layers, bool) else layers
    if not isinstance(items, list) or not items:
        return None
    if not all(isinstance(x, int) and not isinstance(x, bool) and -n <= x < n for x in items):
        return None
    out = [x % n for x in items]
    return out if len(set(out)) == len(out) else None


@SETTINGS
@given(layers=LAYER_ARGS, reducer=st.sampled_from(["received", "topk", "kv"]))
def test_reducer_layers_are_the_documented_ones_or_a_typed_error(llada, layers, reducer):
    expected = _expected_layers(layers, llada.cfg.n_layers)
    make = {"received": lambda: ReceivedAttention(layers=layers), "topk": lambda: TopKKeys(k=2, layers=layers),
            "kv": lambda: KeyValueNorms(layers=layers)}[reducer]
    try:
        out = llada.generate(torch.tensor([[5, 6]]), steps=2, gen_length=2, record=[make()])
    except MDMLensError:
        assert expected is None
        return
    assert expected is not None
    meta = next(iter(out.record_meta.values()))
    assert meta["layers"] == expected
    for value in out.records.values():
        assert value.shape[2] == len(expected)


@SETTINGS
@given(k=st.one_of(st.integers(-2, 12), st.floats(allow_nan=True), st.booleans(), st.text(max_size=2)))
def test_topk_k_is_an_int_up_to_the_sequence_or_a_typed_error(llada, k):
    total = 6
    try:
        out = llada.generate(torch.tensor([[5, 6, 7, 8]]), steps=2, gen_length=2, record=[TopKKeys(k=k)])
    except MDMLensError:
        assert not (isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= total)
        return
    keys, att = out.records["topk_keys"], out.records["topk_attention"]
    assert keys.shape[-1] == k
    # a bidirectional run without padding: every query sees every key, so no entry is absent
    assert ((keys >= 0) & (keys < total)).all() and torch.isfinite(att).all()


def test_topk_absent_keys_are_a_sentinel_that_cannot_index(arm):
    out = arm.generate(torch.tensor([[5, 6]]), gen_length=4, record=[TopKKeys(k=4)])
    keys, att = out.records["topk_keys"], out.records["topk_attention"]   # [step, batch, layer, head, query, k]
    # step 0: a prefix of 2; query 0 sees key 0 only, query 1 keys 0-1; rows 2.. do not exist yet
    q0, q1 = keys[0, 0, 0, 0, 0], keys[0, 0, 0, 0, 1]
    assert q0[0] == 0 and (q0[1:] == TopKKeys.ABSENT).all() and torch.isnan(att[0, 0, 0, 0, 0, 1:]).all()
    assert sorted(q1[:2].tolist()) == [0, 1] and (q1[2:] == TopKKeys.ABSENT).all()
    assert (keys[0, 0, 0, 0, 2:] == TopKKeys.ABSENT).all()
    valid = keys != TopKKeys.ABSENT
    assert torch.isfinite(att[valid]).all() and torch.isnan(att[~valid]).all()
    with pytest.raises(IndexError):
        torch.arange(6)[q0]  # unlike -1, the sentinel is never a valid index


def test_kv_norms_pad_absent_positions_with_nan(arm):
    out = arm.generate(torch.tensor([[5, 6]]), gen_length=3, record=[KeyValueNorms()])
    k = out.records["key_norms"]  # [step, batch, layer, kv_head, pos]; step s sees a prefix of 2 + s
    for s in range(3):
        assert torch.isfinite(k[s, ..., : 2 + s]).all() and torch.isnan(k[s, ..., 2 + s:]).all()


@pytest.mark.parametrize("bad, error", [
    (dict(query="maskd"), InputError), (dict(kind="sum"), InputError), (dict(name=""), ArgumentTypeError),
    (dict(name=3), ArgumentTypeError), (dict(when=4.5), ArgumentTypeError), (dict(when="middle"), SamplerConfigError),
    (dict(when=steps(phases=("uncond",))), SamplerConfigError),
    (dict(when=steps(phases=("cond", "uncond"))), SamplerConfigError),
    (dict(layers=torch.tensor([0.5])), ArgumentTypeError), (dict(layers=[]), InputError)])
def test_reducer_arguments_are_refused_at_construction(bad, error):
    with pytest.raises(error):
        ReceivedAttention(**bad)


def test_reducer_steps_accept_lists_like_hook_steps(llada):
    out = llada.generate(torch.tensor([[5, 6]]), steps=4, gen_length=4, record=[ReceivedAttention(when=[0, -1])])
    assert out.record_meta["received_attention"]["steps"] == [0, 3]


# --- step selectors ----------------------------------------------------------------------------------------------
STEP = st.one_of(st.integers(-7, 7), st.sampled_from(["first", "last", "middle"]), st.floats(allow_nan=True),
                 st.booleans(), st.none())


def _expected_steps(indices, every, blocks, n_steps, n_blocks, steps_per_block):
    """The cached steps by the documented rule, or None where a typed error is due."""
    chosen = set()
    for s in indices:
        s = {"first": 0, "last": -1}.get(s, s) if isinstance(s, str) else s
        if not (isinstance(s, int) and not isinstance(s, bool)) or not -n_steps <= s < n_steps or s % n_steps in chosen:
            return None
        chosen.add(s % n_steps)
    if every is not None and not (isinstance(every, int) and not isinstance(every, bool) and every >= 1):
        return None
    if blocks is not None:
        if not blocks or len(set(blocks)) != len(blocks) or any(b < 0 or b >= n_blocks for b in blocks):
            return None
    if indices and every is not None and any(s % every and s != n_steps - 1 for s in chosen):
        return None  # an explicit step off every='s grid would never fire: refused
    out = []
    for s in range(n_steps):
        if indices and s not in chosen:
            continue
        if every is not None and s % every and s != n_steps - 1:
            continue
        if blocks is not None and s // steps_per_block not in blocks:
            continue
        out.append(s)
    return out


@SETTINGS
@given(indices=st.lists(STEP, max_size=3), every=st.one_of(st.none(), st.integers(-1, 5), st.floats(allow_nan=True)),
       blocks=st.one_of(st.none(), st.lists(st.integers(-1, 3), max_size=3)), n_blocks=st.sampled_from([1, 2]))
def test_step_selectors_cache_the_documented_steps_or_raise(llada, indices, every, blocks, n_blocks):
    n_steps, gen = 4, 4
    expected = _expected_steps(indices, every, blocks, n_steps, n_blocks, n_steps // n_blocks)
    try:
        out = llada.generate(torch.tensor([[5, 6]]), steps=n_steps, gen_length=gen, block_length=gen // n_blocks,
                             cache="blocks.0.hook_resid_post" @ steps(*indices, every=every, blocks=blocks))
    except MDMLensError:
        assert expected is None
        return
    assert out.cache.steps == expected


@pytest.mark.parametrize("cfg_scale, phases, expected", [
    (1.0, ("cond", "uncond"), {"cond": [0, 1, 2], "uncond": [0, 1, 2]}),
    (1.0, ("uncond",), {"uncond": [0, 1, 2]}),
    (0.0, ("uncond",), None), (0.0, ("cond", "uncond"), {"cond": [0, 1, 2], "uncond": []}),
    (0.0, ("encoder",), None)])
def test_cache_phases(llada, cfg_scale, phases, expected):
    kw = dict(steps=3, gen_length=3, cfg_scale=cfg_scale, cache="hook_embed" @ steps(phases=phases))
    prompt = torch.tensor([[5, 6]])
    if expected is None:
        with pytest.raises(SamplerConfigError, match="never run"):
            llada.generate(prompt, **kw)
        return
    out = llada.generate(prompt, **kw)
    assert {p: out.cache.steps_of(p) for p in phases} == expected
    if "uncond" in phases and expected["uncond"]:
        # the unconditional pass sees the prompt masked: its embedding there is the mask token's
        emb = out.cache[1, "uncond"]["hook_embed"]
        assert torch.allclose(emb[0, :2], llada.embed(torch.tensor([[MASK, MASK]]))[0])
        if "cond" in phases:
            assert torch.allclose(out.cache[1]["hook_embed"][0, :2], llada.embed(prompt)[0])


def test_cache_blocks_that_do_not_exist_are_named(llada):
    with pytest.raises(SamplerConfigError, match=r"blocks\[0\]=5 does not exist: this run has 2 block\(s\) \(\[0, 1\]\)"):
        llada.generate(torch.tensor([[5, 6]]), steps=4, gen_length=4, block_length=2,
                       cache="hook_embed" @ steps(blocks=[5]))


# --- TrajectoryCache and generate's observation arguments --------------------------------------------------------
@SETTINGS
@given(budget=st.one_of(st.integers(-5, 5), st.floats(allow_nan=True), st.text(max_size=2)),
       names=st.one_of(st.just("hook_embed"), st.just([]), st.integers(), st.just(["hook_embed", 3]), st.none()),
       device=st.sampled_from(["cpu", "cuda:7", "tpu", 3, None]))
def test_trajectory_cache_arguments(budget, names, device):
    ok_budget = isinstance(budget, int) and not isinstance(budget, bool) and budget >= 1
    ok_names = names == "hook_embed"
    ok_device = device in ("cpu", None) or (device == "cuda:7" and torch.cuda.device_count() > 7)
    try:
        TrajectoryCache(names, budget_bytes=budget, device=device)
    except MDMLensError:
        assert not (ok_budget and ok_names and ok_device)
        return
    assert ok_budget and ok_names and ok_device


@SETTINGS
@given(key=st.one_of(st.integers(-5, 5), st.floats(allow_nan=True), st.text(max_size=1),
                     st.tuples(st.integers(0, 2), st.sampled_from(["cond", "uncond", "x"]))))
def test_cache_lookup_is_a_cached_step_or_a_typed_error(llada, key):
    out = llada.generate(torch.tensor([[5, 6]]), steps=3, gen_length=3, cache="hook_embed" @ steps(0, 2))
    step, phase = key if isinstance(key, tuple) else (key, None)
    # a negative step counts from the end of the 3-step run (as steps(-1)): -1 is step 2, -3 step 0; -2 (step 1)
    # was not cached
    valid = isinstance(step, int) and phase in (None, "cond") and step in (0, 2, -1, -3)
    try:
        out.cache[key]
    except MDMLensError:
        assert not valid
        return
    assert valid


@SETTINGS
@given(arg=st.sampled_from(["fwd_hooks", "hook_steps", "record", "cache", "seed", "progress"]),
       value=st.one_of(st.integers(-3, 3), st.floats(allow_nan=True), st.text(max_size=3), st.booleans(),
                       st.just(ReceivedAttention()), st.just(("hook_embed", lambda x, hook: None)),
                       st.lists(st.integers(), max_size=2)))
def test_generate_observation_arguments_raise_typed_errors(llada, arg, value):
    try:
        llada.generate(torch.tensor([[5, 6]]), steps=2, gen_length=2, **{arg: value})
    except MDMLensError:
        return
    # the values that are valid by the docstring
    assert (arg == "seed" and isinstance(value, int) and not isinstance(value, bool) and value >= 0) or (
        arg == "progress" and isinstance(value, bool)) or (
        arg == "hook_steps" and (value in (0, 1, -1, -2) or value == [] or isinstance(value, list))) or (
        arg in ("fwd_hooks", "record") and value == []), (arg, value)


# --- hooks that break the run ------------------------------------------------------------------------------------
def _nan_at(step: int, phase: str = "cond"):
    def hook(x, hook):
        return x * float("nan")
    return at_steps(hook, steps(step, phases=(phase,)), name="blocks.0.hook_resid_post")


@pytest.mark.parametrize("kind, kw", [("llada", dict(steps=4, gen_length=4)),
                                      ("llada_cfg", dict(steps=4, gen_length=4, cfg_scale=1.0)),
                                      ("dream", dict(steps=4, gen_length=4, alg="entropy")),
                                      ("arm", dict(gen_length=4))])
def test_non_finite_logits_raise_at_that_step(llada, dream, arm, kind, kw):
    model = {"llada": llada, "llada_cfg": llada, "dream": dream, "arm": arm}[kind]
    phase = "uncond" if kind == "llada_cfg" else "cond"
    with pytest.raises(NonFiniteError, match=f"denoising step 2 \\(phase '{phase}'\\).*blocks.0.hook_resid_post"):
        model.generate(torch.tensor([[5, 6]]), fwd_hooks=[_nan_at(2, phase)], **kw)
    assert not any(h.fwd_hooks for h in model.hook_dict.values())  # hooks removed after the raise


def test_non_finite_check_ignores_pad_rows_and_allows_banned_tokens():
    from mdm_lens.diffusion.state import DenoisingState
    from mdm_lens.hooks.runner import check_logits

    logits = torch.zeros(2, 3, 5)
    logits[1, 0] = float("nan")  # a pad row of row 1
    logits[:, :, 3] = float("-inf")  # banning a token is a legitimate edit
    visible = torch.tensor([[True, True, True], [False, True, True]])
    state = DenoisingState(0, 1, 0, 1, torch.zeros(2, 3, dtype=torch.long), visible, visible, visible)
    check_logits(logits, state)
    logits[1, 1, 2] = float("inf")
    with pytest.raises(NonFiniteError, match="0 NaN, 1 \\+inf"):
        check_logits(logits, state)
    logits[1, 1] = float("-inf")  # a row without a finite logit
    with pytest.raises(NonFiniteError, match="1 row"):
        check_logits(logits, state)


@pytest.mark.parametrize("how", ["generate", "run_with_hooks", "hooks"])
def test_a_hook_returning_the_wrong_shape_names_the_hook(llada, how):
    def bad(x, hook):
        return x[:, :1]

    tokens = torch.tensor([[5, 6, MASK]])
    match = r"hook on blocks\.1\.hook_resid_mid returned shape \(1, 1, 32\), expected the activation's shape \(1, 3, 32\)"
    with pytest.raises(InputError, match=match):
        if how == "generate":
            llada.generate(tokens[:, :2], steps=1, gen_length=1, fwd_hooks=[("blocks.1.hook_resid_mid", bad)])
        elif how == "run_with_hooks":
            llada.run_with_hooks(tokens, fwd_hooks=[(lambda n: n == "blocks.1.hook_resid_mid", bad)])
        else:
            with llada.hooks(fwd_hooks=[("blocks.1.hook_resid_mid", bad)]):
                llada(tokens)
    with pytest.raises(InputError, match="returned 'x'"):
        llada.run_with_hooks(tokens, fwd_hooks=[("blocks.1.hook_resid_mid", lambda x, hook: "x")])
    assert not any(h.fwd_hooks for h in llada.hook_dict.values())


# --- devices -----------------------------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_cuda_without_cuda_is_a_typed_error(llada):
    from mdm_lens.errors import ArgumentError

    for call in (lambda: llada.to("cuda"), lambda: llada.to(device="cuda:0"), lambda: llada.cuda(),
                 lambda: HookedMDM.from_pretrained("mdm-lens/tiny-mdm", device="cuda"),
                 lambda: TrajectoryCache("hook_embed", device="cuda")):
        with pytest.raises(ArgumentError, match="CUDA is not available"):
            call()
    assert next(llada.parameters()).device.type == "cpu"
    with pytest.raises(ArgumentTypeError):
        validate.device("gpu0")
    assert validate.device("cpu") == torch.device("cpu") and not math.isnan(0.0)
