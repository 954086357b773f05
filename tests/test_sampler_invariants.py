"""Sampler bookkeeping invariants over random settings, for every registered sampler and block layout (issue 32 A):

1. `out.replay(model, k)` recomputes the forward of step k: the same state (step, block, block_slice with the prompt
   offset, masked / prompt / visible sets) and the same final residual on the rows the sampler computed;
2. `state.is_last` is true at exactly one step of a run of fixed length, and raises `UnknownLengthError` during a
   run whose length is decided as it goes (a replay, made after the run, answers);
3. stop handling never reads the prompt: on a model whose logits depend only on (step, position), a prompt holding
   the stop token runs exactly as the same prompt with an ordinary token there;
4. every generated position goes from mask to token exactly once (or never, after a stop), at the step
   `trajectory.commit_step` names, and `n_committed` counts those steps;
plus the registry's neutral-option rule, table-driven from the registry itself.

Models have realistic weights (`init="realistic"`, family checkpoints in their hub layouts for LLaDA2 and SDAR); a
forward hook on the unembedding bans the mask token only, so that a random model never samples it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from families.family_checkpoints import write_llada2, write_sdar
from mdm_lens import HookedMDM, MDMConfig
from mdm_lens.diffusion import registry
from mdm_lens.diffusion.state import DenoisingState
from mdm_lens.errors import MDMLensError, SamplerConfigError, UnknownLengthError

SETTINGS = settings(max_examples=2, deadline=None, derandomize=True, phases=[Phase.generate],
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
HOOK = "ln_final.hook_normalized"


def _canvas_model(kind: str) -> HookedMDM:
    extra = {"block_length": 4} if kind == "fastdllm_v2" else {}
    cfg = MDMConfig(d_model=32, n_layers=2, n_heads=2, n_kv_heads=2, d_mlp=48, d_vocab=50, mask_token_id=49,
                    attention="causal" if kind == "arm" else "bidirectional", n_ctx=64, eos_token_id=1,
                    pad_token_id=0, logit_shift=kind in ("dream", "fastdllm_v2"),
                    family="fastdllm_v2" if kind == "fastdllm_v2" else None, extra=extra)
    return HookedMDM.from_config(cfg, seed=3, init_std=0.2, init="realistic")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {kind: _canvas_model(kind) for kind in ("llada", "dream", "arm", "fastdllm_v2")}
    root = tmp_path_factory.mktemp("families")
    out["llada2"] = HookedMDM.from_pretrained(str(write_llada2(root / "llada2", seed=1)[0]), load_tokenizer=False)
    out["sdar"] = HookedMDM.from_pretrained(str(write_sdar(root / "sdar", seed=2)[0]), load_tokenizer=False)
    return out


# (sampler, settings drawn from the hypothesis data): every registered sampler but DiffusionGemma (a bridge model)
def _cases(gen: int, steps: int, bl: int) -> list[tuple[str, dict]]:
    return [
        ("llada", dict(gen_length=gen, steps=steps)),
        ("llada", dict(gen_length=gen, steps=gen // bl * 2, block_length=bl, temperature=0.7, cfg_scale=0.5)),
        ("llada", dict(gen_length=gen, steps=steps, remasking="random")),
        ("llada", dict(gen_length=gen, block_length=bl, threshold=0.3)),
        ("llada", dict(gen_length=gen, block_length=bl, factor=1.0)),
        ("dream", dict(gen_length=gen, steps=steps)),
        ("dream", dict(gen_length=gen, steps=steps, alg="entropy", temperature=0.5)),
        ("dream", dict(gen_length=gen, block_length=bl, threshold=0.3, kv_cache="prefix")),
        ("llada", dict(gen_length=gen, block_length=bl, steps=gen, kv_cache="dual")),
        ("arm", dict(gen_length=gen)),
        ("arm", dict(gen_length=gen, stop_at_eos=True, temperature=1.0)),
        ("llada2", dict(gen_length=gen, block_length=bl, steps=bl)),
        ("llada2", dict(gen_length=gen, block_length=bl, steps=bl, threshold=0.3, temperature=0.8)),
        ("llada2", dict(gen_length=gen, block_length=bl, editing_threshold=0.9, max_post_steps=1)),
        ("sdar", dict(gen_length=gen, block_length=bl, steps=bl)),
        ("sdar", dict(gen_length=gen, block_length=bl, steps=bl, remasking_strategy="low_confidence_static")),
        ("sdar", dict(gen_length=gen, block_length=bl, steps=bl, remasking_strategy="sequential")),
        ("sdar", dict(gen_length=gen, block_length=bl, steps=bl, remasking_strategy="entropy_bounded",
                      eb_threshold=0.5)),
        ("fastdllm_v2", dict(max_new_tokens=gen, threshold=0.5, small_block_size=2)),
        ("fastdllm_v2", dict(max_new_tokens=gen, factor=True, factor_value=1.0, small_block_size=2)),
    ]


N_CASES = len(_cases(8, 8, 4))
CASES = pytest.mark.parametrize("case", range(N_CASES), ids=[f"{n}-{i}" for i, (n, _) in enumerate(_cases(8, 8, 4))])


def _ban(model: HookedMDM, tokens: list[int]):
    """A torch forward hook on the unembedding: the given tokens' logits pinned very low (a random model would
    otherwise sample the mask token, which no sampler's schedule accounts for)."""
    def hook(module, args, out):
        out = out.clone()
        out[..., tokens] = -1e4
        return out

    return model.unembed.register_forward_hook(hook)


def _snapshot(state) -> dict:
    try:
        last = state.is_last
    except UnknownLengthError:
        last = "unknown"
    keep = {k: state.extra[k] for k in ("kind", "query_start", "query_end") if k in state.extra}
    return dict(step=state.step, n_steps=state.n_steps, block=state.block, n_blocks=state.n_blocks,
                block_slice=state.block_slice, x=state.x.clone(), masked=state.masked.clone(),
                prompt=state.prompt.clone(), key_visible=state.key_visible.clone(), phase=state.phase,
                query_position=None if state.query_position is None else state.query_position.clone(),
                extra=keep, last=last)


def _run(model, sampler, kw, prompt, seed):
    seen: list[tuple[dict, torch.Tensor]] = []

    def spy(x, hook):
        if model.state.phase == "cond":
            seen.append((_snapshot(model.state), x.detach().clone()))

    handle = _ban(model, [model.cfg.mask_token_id])
    try:
        out = model.generate(prompt, sampler=sampler, seed=seed, fwd_hooks=[(HOOK, spy)], **kw)
    finally:
        handle.remove()
    return out, seen


def _draw(data, models, case):
    bl = data.draw(st.sampled_from([2, 4]), label="block_length")
    gen = bl * data.draw(st.integers(2, 3), label="blocks")
    steps = data.draw(st.sampled_from([gen // 2, gen]), label="steps")
    sampler, kw = _cases(gen, steps, bl)[case]
    model = models[sampler]
    if sampler == "fastdllm_v2":
        kw = dict(kw, small_block_size=min(kw["small_block_size"], 4))
    length = data.draw(st.integers(2, 6), label="prompt_length")
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 99), label="prompt_seed"))
    prompt = torch.randint(3, 40, (1, length), generator=g)
    return sampler, kw, model, prompt


@CASES
@SETTINGS
@given(data=st.data())
def test_replay_recomputes_every_step_and_its_state(models, case, data):
    sampler, kw, model, prompt = _draw(data, models, case)
    out, seen = _run(model, sampler, kw, prompt, seed=data.draw(st.integers(0, 9), label="seed"))
    assert len(seen) == out.n_steps
    handle = _ban(model, [model.cfg.mask_token_id])
    try:
        for k in sorted({0, len(seen) // 2, len(seen) - 1}):  # first, middle, last: keeps the file under a minute
            state, resid = seen[k]
            got = []
            try:
                out.replay(model, k, fwd_hooks=[(HOOK, lambda x, hook: got.append((_snapshot(model.state),
                                                                                    x.detach().clone())))])
            except SamplerConfigError as e:  # documented refusals only: runs read stale cached keys/values
                assert "kv_cache" in str(e) or "block cache" in str(e), str(e)
                return
            (rstate, rresid), = got
            _same_state(state, rstate, adaptive=state["last"] == "unknown")
            lo, hi = state["extra"].get("query_start", 0), state["extra"].get("query_end", rresid.shape[1])
            rows = rresid[:, lo:hi] if rresid.shape[1] != resid.shape[1] else rresid
            torch.testing.assert_close(rows, resid, rtol=1e-5, atol=1e-5 * float(resid.abs().max()))
    finally:
        handle.remove()


def _same_state(a: dict, b: dict, adaptive: bool) -> None:
    for key in ("step", "block", "n_blocks", "block_slice", "phase", "extra"):
        assert a[key] == b[key], (key, a[key], b[key])
    if not adaptive:  # an adaptive run's forwards see the bound; its replay the steps it ran
        assert a["n_steps"] == b["n_steps"]
    width = b["x"].shape[1]
    for key in ("x", "masked", "prompt", "key_visible"):
        assert torch.equal(a[key][:, :width].cpu(), b[key].cpu()), key
    if a["query_position"] is not None:
        assert torch.equal(a["query_position"].cpu(), b["query_position"].cpu())


@CASES
@SETTINGS
@given(data=st.data())
def test_is_last_is_true_exactly_once_or_refused(models, case, data):
    sampler, kw, model, prompt = _draw(data, models, case)
    out, seen = _run(model, sampler, kw, prompt, seed=0)
    lasts = [s["last"] for s, _ in seen]
    if "unknown" in lasts:
        assert set(lasts) == {"unknown"}  # all forwards of an adaptive run, none answered False by mistake
        x = torch.zeros(1, 3, dtype=torch.long)
        state = DenoisingState(2, 3, 0, 1, x, x == 1, x == 0, x == 0, extra={"unknown_length": "a test"})
        with pytest.raises(UnknownLengthError, match="is_last is unknown at step 2: a test"):
            state.is_last
    else:
        assert lasts == [False] * (len(lasts) - 1) + [True]
    if out.settings.get("kv_cache") is None:  # kv_cache runs refuse replay (stale cached keys)
        replayed = [out.state_at(k).is_last for k in range(out.n_steps)]
        assert replayed == [False] * (out.n_steps - 1) + [True]


@CASES
@SETTINGS
@given(data=st.data())
def test_every_masked_slot_is_committed_once_where_commit_step_says(models, case, data):
    sampler, kw, model, prompt = _draw(data, models, case)
    out, seen = _run(model, sampler, kw, prompt, seed=data.draw(st.integers(0, 9), label="seed"))
    tr = out.trajectory
    n, p0 = out.n_steps, out.prompt_length
    hole = -1 if out.causal else model.cfg.mask_token_id
    canvases = torch.cat([tr.x_steps, out.tokens[None].to(tr.x_steps)], dim=0)[:, :, p0:]
    masked = canvases == hole
    assert bool(masked[0].all()), "the first canvas holds only masks after the prompt"
    unmask = masked[:-1] & ~masked[1:]
    assert not bool((~masked[:-1] & masked[1:]).any()), "a committed token became a mask again"
    assert int(unmask.sum(0).max()) <= 1
    step = torch.where(unmask.any(0), unmask.int().argmax(0), torch.full_like(tr.commit_step[:, p0:], -1))
    assert torch.equal(tr.commit_step[:, p0:], step)
    assert bool((tr.commit_step[:, :p0] == -1).all())
    counts = torch.stack([(tr.commit_step == k).sum(-1) for k in range(n)])
    assert torch.equal(tr.n_committed, counts.to(tr.n_committed))
    for k, (state, _) in enumerate(seen):  # the states the hooks saw are the canvases the trajectory keeps
        width = min(state["x"].shape[1], tr.x_steps.shape[2])
        assert torch.equal(state["x"][:, :width].cpu(), tr.x_steps[k][:, :width].cpu())
        if not out.causal:
            holes = state["x"] == model.cfg.mask_token_id
            if sampler == "fastdllm_v2":  # its masked set stops at the current block (documented)
                holes[:, state["block_slice"].stop:] = False
            assert torch.equal(state["masked"], holes)


# --- 3. stop handling never reads the prompt ----------------------------------------------------------------------
STOP_CASES = [  # (sampler, settings, the stop token a setting or the checkpoint names)
    ("arm", dict(gen_length=8, stop_at_eos=True, temperature=1.0), "eos"),
    ("llada2", dict(gen_length=8, block_length=2, steps=2), "eos"),
    ("llada2", dict(gen_length=8, block_length=2, editing_threshold=0.9, max_post_steps=1, eos_early_stop=True), "eos"),
    ("sdar", dict(gen_length=8, block_length=2, steps=2, stopping_criteria_idx=(5,)), 5),
    ("fastdllm_v2", dict(max_new_tokens=8, threshold=0.5, small_block_size=2, stop_token=5), 5),
]


def _pinned(model: HookedMDM, banned: list[int], seed: int, boost: int | None = None):
    """Logits that depend only on (step, absolute position of the row): the prompt's content cannot change them."""
    vocab = model.cfg.d_vocab

    def hook(module, args, out):
        state = model.state
        g = torch.Generator().manual_seed(seed * 1000 + state.step)
        table = 3 * torch.randn(model.cfg.n_ctx + 1, vocab, generator=g)
        table[:, banned] = -1e4
        if boost is not None:
            table[:, boost] = 8.0
        n = out.shape[1]
        lo = state.extra.get("query_start", 0) if n == state.extra.get("query_end", -1) - state.extra.get(
            "query_start", 0) else 0
        return table[lo:lo + n][None].expand(out.shape[0], n, vocab).to(out)

    return model.unembed.register_forward_hook(hook)


@pytest.mark.parametrize("sampler,kw,stop", STOP_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(STOP_CASES)])
@pytest.mark.parametrize("seed", [0, 1])
def test_a_stop_token_in_the_prompt_changes_nothing(models, sampler, kw, stop, seed):
    model = models[sampler]
    stop = model.cfg.eos_token_id if stop == "eos" else stop
    runs = []
    for planted in (stop, 7):
        prompt = torch.tensor([[11, 12, planted, 13, 14]])
        handle = _pinned(model, [model.cfg.mask_token_id, stop], seed)
        try:
            runs.append(model.generate(prompt, sampler=sampler, seed=seed, **kw))
        finally:
            handle.remove()
    a, b = runs
    assert a.n_steps == b.n_steps
    assert torch.equal(a.tokens[:, a.prompt_length:], b.tokens[:, b.prompt_length:])
    assert torch.equal(a.trajectory.commit_step, b.trajectory.commit_step)


def test_the_stop_rule_is_live_on_these_rigs(models):
    """Guards test 3 against a vacuous pass: with the stop token favoured instead of banned, every run stops earlier."""
    for sampler, kw, stop in STOP_CASES:
        model = models[sampler]
        stop = model.cfg.eos_token_id if stop == "eos" else stop
        prompt = torch.tensor([[11, 12, 7, 13, 14]])
        ends = []
        for banned, boost in (([model.cfg.mask_token_id, stop], None), ([model.cfg.mask_token_id], stop)):
            handle = _pinned(model, banned, 0, boost)
            try:
                ends.append(model.generate(prompt, sampler=sampler, seed=0, **kw).n_steps)
            finally:
                handle.remove()
        assert ends[1] < ends[0], (sampler, ends)


# --- the registry's neutral-option rule -----------------------------------------------------------------------------
NEUTRAL = [(owner.name, option, value) for owner in map(registry.get, registry.names())
           for option, value in owner.neutral.items()]


@pytest.mark.parametrize("owner,option,value", NEUTRAL, ids=[f"{o}.{p}" for o, p, _ in NEUTRAL])
def test_another_samplers_option_passes_only_at_its_neutral_value(models, owner, option, value):
    for sampler in ("llada", "dream", "arm"):
        me = registry.get(sampler)
        if option in registry.settings_names(me):
            continue
        owners = [registry.get(n) for n in registry.names() if option in registry.settings_names(registry.get(n))
                  and n != sampler]
        neutral_everywhere = all(o.is_neutral(option, value, {}) for o in owners)
        if neutral_everywhere:
            me.settings(models[sampler], {option: value})  # accepted: it does nothing wherever it exists
        with pytest.raises(SamplerConfigError, match=f"unknown setting {option}="):
            me.settings(models[sampler], {option: _not_neutral(value)})


def _not_neutral(value):
    if isinstance(value, bool):
        return not value
    if value is None:
        return 0.25
    if isinstance(value, (int, float)):
        return value + 2
    return value + "_other"


def test_a_refused_neutral_error_is_typed(models):
    with pytest.raises(MDMLensError, match="cfg_scale=.*sampler 'llada'"):
        registry.get("dream").settings(models["dream"], {"cfg_scale": 0.5})


def test_eos_early_stop_refuses_a_prompt_holding_eos(models):
    """LLaDA2's eos_early_stop searches EOS from position 0 (the reference's quirk): refused, not silently empty."""
    model = models["llada2"]
    with pytest.raises(MDMLensError, match="the prompt contains the EOS id 98"):
        model.generate(torch.tensor([[11, 98, 12]]), sampler="llada2", gen_length=4, block_length=2, steps=2,
                       eos_early_stop=True)


@pytest.mark.parametrize("adaptive", [False, True])
def test_diffusion_gemma_is_last(adaptive):
    """DiffusionGemma (a bridge model): with stopping off every forward of the last step says so and no other; with
    adaptive stopping on, every forward (encoder passes included) refuses to guess."""
    from mdm_lens.bridge import TransformersBridge
    from mdm_lens.bridge.tiny import tiny_diffusion_gemma

    bridge = TransformersBridge(tiny_diffusion_gemma(seed=0))
    kw = dict(max_new_tokens=16, max_denoising_steps=3, eos_token_id=None, entropy_bound=0.5, t_min=0.3, t_max=0.9)
    kw.update(dict(stability_threshold=0, confidence_threshold=1e-6) if adaptive else
              dict(stability_threshold=None, confidence_threshold=None))
    seen = []

    def spy(x, hook):
        try:
            seen.append((bridge.state.step, bridge.state.is_last))
        except UnknownLengthError:
            seen.append((bridge.state.step, "unknown"))

    names = [n for n in bridge.hook_dict if n.endswith("hook_resid_post")][:1]
    out = bridge.generate(torch.randint(2, 128, (1, 5), generator=torch.Generator().manual_seed(0)), seed=0,
                          fwd_hooks=[(names[0], spy)], **kw)
    if adaptive:
        assert {v for _, v in seen} == {"unknown"}
    else:
        assert {s for s, v in seen if v is True} == {out.n_steps - 1}
        assert all(v is False for s, v in seen if s != out.n_steps - 1)
