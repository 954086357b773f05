"""generate's arguments: typed errors before compute, property-based (hypothesis) checks that valid settings
never raise and invalid ones always raise the typed error, padding checks, defaults, replay and summaries."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mdm_lens import (ArgumentError, ArgumentTypeError, HookedMDM, InputError, MDMConfig, ReceivedAttention,
                      SamplerConfigError, at_steps, steps)
from mdm_lens.diffusion.arguments import IdleStepsWarning

MASK, EOS, EOT = 19, 1, 2
_MODELS: dict = {}


def tiny(kind="llada", **extra):
    key = (kind, tuple(sorted(extra.items())))
    if key not in _MODELS:
        cfg = MDMConfig(d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_mlp=16, d_vocab=20, mask_token_id=MASK,
                        attention="causal" if kind == "arm" else "bidirectional", logit_shift=kind == "dream",
                        n_ctx=24, eos_token_id=EOS, pad_token_id=0, extra=dict({"eot_token_id": EOT}, **extra))
        _MODELS[key] = HookedMDM.from_config(cfg, seed=0, init_std=0.3)
    return _MODELS[key]


PROMPT = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]])
FAST = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def run(kind="llada", prompt=PROMPT, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IdleStepsWarning)
        return tiny(kind).generate(prompt, **kw)


# --- property-based: valid settings never raise ---------------------------------------------------------

@st.composite
def prompts(draw, causal=False):
    b = draw(st.integers(1, 2))
    p = draw(st.integers(1, 5))
    ids = torch.tensor(draw(st.lists(st.lists(st.integers(0, 18), min_size=p, max_size=p), min_size=b, max_size=b)))
    pads = [draw(st.integers(0, p - 1)) for _ in range(b)]
    am = torch.ones(b, p, dtype=torch.long)
    for r, n in enumerate(pads):
        am[r, :n] = 0
    return ids, am


@st.composite
def llada_settings(draw):
    gen = draw(st.integers(1, 6))
    block = draw(st.sampled_from([d for d in range(1, gen + 1) if gen % d == 0]))
    n_blocks = gen // block
    return dict(gen_length=gen, block_length=block, steps=n_blocks * draw(st.integers(1, 3)),
                temperature=draw(st.sampled_from([0, 0.0, 0.5, 1.7])), cfg_scale=draw(st.sampled_from([0.0, 0.5, 2])),
                remasking=draw(st.sampled_from(["low_confidence", "random"])),
                logits_eos_inf=draw(st.booleans()), confidence_eos_eot_inf=draw(st.booleans()),
                seed=draw(st.one_of(st.none(), st.integers(0, 2**31))))


@st.composite
def dream_settings(draw):
    gen = draw(st.integers(1, 6))
    alg = draw(st.sampled_from(["origin", "maskgit_plus", "topk_margin", "entropy"]))
    temps = [None, 0] if alg == "origin" else [None, 0, 0.3, 2.0]  # origin never reads alg_temp: refused there
    return dict(gen_length=gen, steps=draw(st.integers(1, 2 * gen)), alg=alg,
                alg_temp=draw(st.sampled_from(temps)), eps=draw(st.sampled_from([1e-3, 0.2, 0.9])),
                temperature=draw(st.sampled_from([0.0, 0.4, 1])), top_p=draw(st.sampled_from([None, 0.3, 1.0])),
                top_k=draw(st.sampled_from([None, 1, 3, 100])))


@FAST
@given(llada_settings(), prompts())
def test_valid_llada_settings_never_raise(kw, prompt):
    ids, am = prompt
    out = run("llada", ids, attention_mask=am, **kw)
    assert out.generated.shape == (ids.shape[0], kw["gen_length"])
    assert out.trajectory.n_steps == kw["steps"]


@FAST
@given(dream_settings(), prompts())
def test_valid_dream_settings_never_raise(kw, prompt):
    ids, am = prompt
    out = run("dream", ids, attention_mask=am, **kw)
    assert out.generated.shape == (ids.shape[0], kw["gen_length"])
    assert {k: out.settings[k] for k in ("alg", "top_p", "top_k", "eps")} == {k: kw[k] for k in ("alg", "top_p",
                                                                                              "top_k", "eps")}


@FAST
@given(st.integers(1, 5), st.sampled_from([0.0, 0.5, 3]), st.sampled_from([None, 0.5]),
       st.sampled_from([None, 2]), st.booleans(), prompts())
def test_valid_arm_settings_never_raise(gen, temperature, top_p, top_k, stop, prompt):
    ids, am = prompt
    kw = dict(gen_length=gen, temperature=temperature, top_p=top_p, top_k=top_k, stop_at_eos=stop)
    if temperature == 0 and (top_p, top_k) != (None, None):  # greedy: the filters would be inert, so refused
        with pytest.raises(SamplerConfigError, match="temperature > 0"):
            run("arm", ids, attention_mask=am, **kw)
        return
    out = run("arm", ids, attention_mask=am, **kw)
    assert out.tokens.shape[1] <= ids.shape[1] + gen


# --- property-based: invalid settings always raise the typed error ---------------------------------------

NaN = float("nan")
INVALID = {  # argument -> values that must be refused, with the error class
    "steps": ([4.5, "4", 0, -2, True, 4.0], ArgumentError),
    "gen_length": (["4", 0, -1, 2.0, False], ArgumentError),
    "block_length": ([0, 3, 2.5, "2"], ArgumentError),
    "temperature": ([-0.1, "hot", NaN, math.inf, True], ArgumentError),
    "cfg_scale": ([-1, "x", NaN], ArgumentError),
    "remasking": (["lowest", 1, None], ArgumentError),
    "logits_eos_inf": ([1, "yes", None], ArgumentTypeError),
    "alg": (["greedy"], SamplerConfigError),  # a Dream option given to LLaDA
    "top_k": ([3], SamplerConfigError),  # LLaDA has no top-k filter
    "seed": ([-1, 1.5, "s"], ArgumentError),
    "record": ([ReceivedAttention(), "received_attention", [print]], ArgumentTypeError),
    "cache": ([5, [3]], ArgumentTypeError),
    "fwd_hooks": ([("hook_embed", print), print, [("hook_embed", 3)]], ArgumentTypeError),
    "hook_steps": ([99, 4.5, {"a"}], ArgumentError),
    "progress": (["yes", 1], ArgumentTypeError),
}
DREAM_INVALID = {
    "alg": (["greedy", None, 2], ArgumentError),
    "eps": ([0, 1, 1.5, -0.1, "e"], ArgumentError),
    "alg_temp": ([-1, "t"], ArgumentError),
    "top_p": ([0, 1.5, "p", NaN], ArgumentError),
    "top_k": ([0, -3, 2.5, "k"], ArgumentError),
    "cfg_scale": ([1.0], SamplerConfigError),  # a LLaDA option given to Dream
    "remasking": (["random"], SamplerConfigError),
    "stop_at_eos": ([True], SamplerConfigError),
}


def _cases(table):
    return [(name, value, err) for name, (values, err) in table.items() for value in values]


@FAST
@given(st.sampled_from(_cases(INVALID)), llada_settings())
def test_invalid_llada_arguments_always_raise_the_typed_error(case, kw):
    name, value, err = case
    kw = dict(kw, **{name: value})
    if name == "block_length" and value == 3:
        kw["gen_length"] = 4  # not a divisor
    with pytest.raises(err) as info:
        run("llada", **kw)
    assert isinstance(info.value, ArgumentError)


@FAST
@given(st.sampled_from(_cases(DREAM_INVALID)), dream_settings())
def test_invalid_dream_arguments_always_raise_the_typed_error(case, kw):
    name, value, err = case
    with pytest.raises(err) as info:
        run("dream", **dict(kw, **{name: value}))
    assert info.value.argument == name or name in str(info.value)


def test_wrong_types_name_what_is_expected():
    with pytest.raises(ArgumentTypeError, match=r"steps=4.5 is invalid: expected an int >= 1"):
        run(steps=4.5, gen_length=4)
    with pytest.raises(ArgumentTypeError, match=r"gen_length='4' is invalid: expected an int"):
        run(gen_length="4")
    with pytest.raises(ArgumentTypeError, match=r"record=.*expected a list of Reducer.*write record=\[\.\.\.\]"):
        run(gen_length=4, record=ReceivedAttention())
    with pytest.raises(ArgumentTypeError, match="cache="):
        run(gen_length=4, cache=3.0)


def test_forwards_never_start_when_an_argument_is_bad():
    model, calls = tiny(), []
    hook = ("hook_embed", lambda x, hook: calls.append(1))
    for bad in (dict(steps=4.5), dict(temperature=-1), dict(record=ReceivedAttention()), dict(alg="entropy")):
        with pytest.raises(ArgumentError):
            model.generate(PROMPT, gen_length=4, fwd_hooks=[hook], **bad)
    assert calls == []


# --- prompts and padding ------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt, am, match", [
    (torch.zeros(1, 0, dtype=torch.long), None, "empty"),
    (torch.zeros(0, 3, dtype=torch.long), None, "empty"),
    ([], None, "empty"),
    (PROMPT, torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]]), r"rows \[1\] are all zero"),
    (PROMPT, torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]), "pad on the left"),
    (PROMPT, torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]]), "pad on the left"),
    (PROMPT, torch.tensor([[1, 1, 1, 2], [1, 1, 1, 1]]), "0 \\(pad\\) and 1"),
    (PROMPT, torch.ones(2, 3, dtype=torch.long), "shape"),
    (PROMPT.float(), None, "int"),
    (torch.tensor([[3, MASK]]), None, "mask token"),
])
def test_bad_prompts_and_masks_are_refused(prompt, am, match):
    with pytest.raises(ArgumentError, match=match):
        run(prompt=prompt, attention_mask=am, gen_length=4)


def test_cfg_runs_on_a_left_padded_batch_with_pads_hidden():
    padded = torch.tensor([[0, 0, 5, 6], [3, 4, 5, 6]])
    am = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    out = run(prompt=padded, attention_mask=am, gen_length=4, cfg_scale=1.0)
    assert not (out.generated == MASK).any()
    # the pad positions' token does not matter: they are hidden keys and never committed
    other = run(prompt=padded.masked_fill(am == 0, 7), attention_mask=am, gen_length=4, cfg_scale=1.0)
    assert torch.equal(out.generated, other.generated)


# --- steps > gen_length, defaults, special ids -----------------------------------------------------------

def test_more_steps_than_tokens_warns_naming_the_idle_steps():
    with pytest.warns(IdleStepsWarning, match=r"steps \[3, 4, 5\] commit no token"):  # LLaDA front-loads
        out = tiny().generate(PROMPT, steps=6, gen_length=3)
    assert out.trajectory.n_committed[:, 0].tolist() == [1, 1, 1, 0, 0, 0]
    with pytest.warns(IdleStepsWarning, match=r"steps=6 > gen_length=4: steps \[0, 1, 2\] commit no token"):
        out = tiny("dream").generate(PROMPT, steps=6, gen_length=4, alg="entropy")
    assert out.trajectory.n_committed[:, 0].tolist() == [0, 0, 0, 1, 1, 2]  # int(n (1 - s/t)) truncations
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tiny().generate(PROMPT, steps=3, gen_length=3)  # no warning when every step can commit


def test_gen_length_defaults_to_the_trained_canvas():
    assert tiny("llada", gen_length=3).generate(PROMPT).generated.shape == (2, 3)
    assert tiny("arm", gen_length=2).generate(PROMPT).generated.shape == (2, 2)
    with pytest.raises(SamplerConfigError, match=r"gen_length \(32\)"):  # nothing recorded: 32
        tiny().generate(PROMPT)


def test_settings_list_every_effective_value():
    s = run(gen_length=4).settings
    assert s == dict(steps=4, gen_length=4, temperature=0.0, block_length=4, remasking="low_confidence",
                     cfg_scale=0.0, logits_eos_inf=False, confidence_eos_eot_inf=False, threshold=None, factor=None,
                     sampler_rule="llada", gamma=None, kv_cache=None, eos_id=EOS, eot_id=EOT, seed=0, mask_id=MASK)
    d = run("dream", gen_length=4).settings
    assert d == dict(steps=4, gen_length=4, temperature=1.0, alg="origin", alg_temp=None, eps=1e-3, top_p=1.0,
                     top_k=50, kv_cache=None, block_length=None, threshold=None, factor=None, seed=0,
                     mask_id=MASK)
    a = run("arm", gen_length=4).settings
    assert a == dict(steps=4, gen_length=4, temperature=0.0, top_p=None, top_k=None, stop_at_eos=False, seed=0)


def test_eot_id_comes_from_the_checkpoint_or_the_special_tokens_or_is_an_error():
    cfg = MDMConfig(d_model=16, n_layers=1, n_heads=2, d_mlp=16, d_vocab=20, mask_token_id=MASK, n_ctx=24,
                    eos_token_id=EOS, extra={"special_tokens": {"<|eot_id|>": 4}})
    model = HookedMDM.from_config(cfg, seed=0)
    assert model.generate(PROMPT, gen_length=2, confidence_eos_eot_inf=True).settings["eot_id"] == 4
    model.cfg.extra = {}
    with pytest.raises(SamplerConfigError, match="EoT"):
        model.generate(PROMPT, gen_length=2, confidence_eos_eot_inf=True)
    model.cfg.extra, model.cfg.eos_token_id = {"eot_token_id": 4}, None
    with pytest.raises(SamplerConfigError, match="EOS"):  # at temperature 0 the reference line touches EOS too
        model.generate(PROMPT, gen_length=2, confidence_eos_eot_inf=True)
    assert model.generate(PROMPT, gen_length=2, confidence_eos_eot_inf=True, temperature=0.5).settings["eos_id"] is None
    with pytest.raises(SamplerConfigError, match="EOS"):
        model.generate(PROMPT, gen_length=2, logits_eos_inf=True)


# --- replay, step attributes, summaries ------------------------------------------------------------------

@pytest.mark.parametrize("kind, kw", [("llada", dict(block_length=2, cfg_scale=0.5)), ("dream", dict(alg="entropy", temperature=0)),
                                      ("arm", {})])
def test_replay_reproduces_a_steps_state_hooks_and_logits(kind, kw):
    model = tiny(kind)
    seen = []

    def spy(x, hook):
        st_ = model.state
        seen.append((st_.step, st_.phase, st_.block, st_.x.clone(), st_.masked.clone(), x.clone()))

    hooks = [at_steps(spy, [2], name="blocks.0.hook_resid_post")]
    if kw.get("cfg_scale"):  # an uncond-only hook on a run without CFG is refused (it would never fire)
        hooks.append(at_steps(spy, steps(2, phases=("uncond",)), name="blocks.0.hook_resid_post"))
    out = model.generate(PROMPT, gen_length=4, steps=4, seed=1, **kw, fwd_hooks=hooks)
    inside = list(seen)
    seen.clear()
    logits = out.replay(model, 2, fwd_hooks=hooks)
    assert len(seen) == 1 and model.state is None
    for a, b in zip(inside[0], seen[0]):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    assert torch.equal(seen[0][3], out.trajectory.x_steps[2][:, :seen[0][3].shape[1]])
    # the replayed logits are what the sampler read: the step's greedy commit is their argmax
    committed = out.trajectory.committed_at(2)[:, :logits.shape[1]]
    if kind != "arm":
        assert torch.equal(logits.argmax(-1)[committed], out.tokens[:, :logits.shape[1]][committed])
    else:
        assert torch.equal(logits[:, -1].argmax(-1), out.tokens[:, logits.shape[1]])
    seen.clear()
    out.replay(model, 1, fwd_hooks=hooks)
    assert seen == []  # a hook bound to step 2 does not fire on step 1
    if kind == "llada":
        out.replay(model, -2, fwd_hooks=hooks, phase="uncond")
        assert len(seen) == 1 and seen[0][1] == "uncond" and torch.equal(seen[0][5], inside[1][5])
    else:
        with pytest.raises(SamplerConfigError):
            out.replay(model, 2, phase="uncond")
    with pytest.raises(ArgumentError):
        out.replay(model, 4)


def test_step_bound_objects_share_the_when_attribute():
    fn = lambda x, hook: None  # noqa: E731
    assert at_steps(fn, [0, -1], name="hook_embed").when.resolve(8) == {0, 7}
    assert at_steps(fn, [1]).when.resolve(8) == {1}
    assert ReceivedAttention(when=steps("last")).when.resolve(8) == {7}
    with pytest.raises(ArgumentError):
        steps(every=0)
    with pytest.raises(ArgumentError):
        steps(phases=("both",))
    with pytest.raises(ArgumentTypeError):
        steps(1.5)


def test_trajectory_repr_is_a_summary():
    out = run(gen_length=4, steps=4)
    text = repr(out.trajectory)
    assert text.startswith("Trajectory(steps=4, batch=2, positions=8 (prompt 4), blocks=1;")
    assert "commits per step [1, 1, 1, 1]" in text and "canvas before step s" in text and "tensor(" not in text
    assert f"commit order {out.trajectory.order(0)}" in text
