"""Round 4a of misuse checks (issue #32, held-out round three: findings S1, S2, U4, C0, C1, C2, U2, U3). Each test
pins a class of input that used to pass silently or fail with a raw / misleading error, with the typed error and the
argument it names, or, where the fix makes something work, its exact result against a reference computation."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from mdm_lens import HookedMDM, KeyValueNorms, MDMConfig, ReceivedAttention, TopKKeys, at_steps, steps
from mdm_lens.errors import ArgumentTypeError, ConfigError, InputError, SamplerConfigError

sys.path.insert(0, str(Path(__file__).parent / "families"))
from family_checkpoints import write_llada2, write_lladamoe, write_sdar  # noqa: E402
from nemotron_fixture import write_nemotron  # noqa: E402

PROMPT = torch.tensor([[5, 6, 7, 8]])
NAME = "blocks.0.hook_resid_post"


@pytest.fixture(scope="module")
def tiny():
    return HookedMDM.from_pretrained("mdm-lens/tiny-mdm")


def _no_hooks_left(model) -> bool:
    return not any(h.fwd_hooks for h in model.hook_dict.values())


# --- S1: hook_steps with nothing it applies to ----------------------------------------------------------------------
@pytest.mark.parametrize("extra", [{}, dict(cache=NAME), dict(record=[ReceivedAttention()])])
def test_hook_steps_without_fwd_hooks_is_refused_naming_fwd_hooks(tiny, extra):
    with pytest.raises(SamplerConfigError, match="fwd_hooks is empty") as e:
        tiny.generate(PROMPT, hook_steps=[0], **extra)
    assert e.value.argument == "fwd_hooks" and e.value.value == []
    assert "steps(...)" in str(e.value) and _no_hooks_left(tiny)


# --- S2: hook_steps beside hooks that carry their own steps ---------------------------------------------------------
@pytest.mark.parametrize("how", ["pair", "named"])
def test_hook_steps_with_only_at_steps_hooks_is_refused_and_nothing_fires(tiny, how):
    fired = []
    spy = lambda x, hook: fired.append(tiny.state.step)  # noqa: E731
    hook = (NAME, at_steps(spy, [0])) if how == "pair" else at_steps(spy, [0], name=NAME)
    with pytest.raises(SamplerConfigError, match="fires at its own steps only") as e:
        tiny.generate(PROMPT, fwd_hooks=[hook], hook_steps=[1])
    assert e.value.argument == "hook_steps" and e.value.value == [1]
    assert fired == [] and _no_hooks_left(tiny)


def test_hook_steps_still_chooses_the_steps_of_plain_pairs_beside_at_steps_hooks(tiny):
    plain, bound = [], []
    tiny.generate(PROMPT, hook_steps=[1, 3], fwd_hooks=[(NAME, lambda x, hook: plain.append(tiny.state.step)),
                                                         (NAME, at_steps(lambda x, hook: bound.append(tiny.state.step),
                                                                         [0]))])
    assert plain == [1, 3] and bound == [0]


# --- U4: a (name, at_steps(..., name=...)) pair ----------------------------------------------------------------------
@pytest.mark.parametrize("inner, says", [("blocks.1.hook_resid_post", "disagree"), (NAME, "the same name twice")])
def test_a_pair_holding_a_named_at_steps_hook_says_why(tiny, inner, says):
    with pytest.raises(ArgumentTypeError, match=says) as e:
        tiny.generate(PROMPT, fwd_hooks=[(NAME, at_steps(lambda x, hook: None, [0], name=inner))])
    assert e.value.argument == "fwd_hooks" and "goes in the list on its own" in str(e.value)
    assert inner in str(e.value) and NAME in str(e.value)


# --- C0: every hook point can be cached over steps (shapes measured on the model) ----------------------------------
ROUTING = ["mlp.hook_router_logits", "mlp.hook_expert_indices", "mlp.hook_expert_weights", "mlp.hook_experts_out"]


def _family(kind: str, tmp_path: Path) -> HookedMDM:
    folder = {"llada2": lambda: write_llada2(tmp_path / kind), "lladamoe": lambda: write_lladamoe(tmp_path / kind),
              "sdar": lambda: write_sdar(tmp_path / kind), "sdar_moe": lambda: write_sdar(tmp_path / kind, moe=True)}
    return HookedMDM.from_pretrained(str(folder[kind]()[0]))


@pytest.mark.parametrize("kind", ["llada2", "lladamoe", "sdar", "sdar_moe"])
def test_the_dense_table_agrees_with_the_measured_shapes(kind, tmp_path):
    from mdm_lens.hooks import shape_probe
    from mdm_lens.hooks.memory import hook_shape, is_dense_hook

    model = _family(kind, tmp_path)
    names = [n for n in model.hook_dict if "hook_result" not in n]
    measured = shape_probe.measure(model, names)
    dense = [n for n in names if is_dense_hook(n)]
    assert len(dense) > 20
    for n in dense:
        assert shape_probe.size(measured[n], 3, 11) == math.prod(hook_shape(model.cfg, n, 3, 11)), n
    assert not any(is_dense_hook(n) for n in names if ".experts." in n or "_normed" in n or "router" in n)


def test_moe_and_qk_norm_hooks_cache_exactly_over_steps_lladamoe(tmp_path):
    model = _family("lladamoe", tmp_path)
    names = [f"blocks.1.{h}" for h in ROUTING] + ["blocks.1.attn.hook_q_normed", "blocks.1.attn.hook_k_normed"]
    prompt = torch.tensor([[3, 9, 4, 17, 8]])
    out = model.generate(prompt, steps=4, gen_length=4, cache=names)
    assert out.cache.steps == [0, 1, 2, 3]
    for s in (0, 3):
        _, ref = model.run_with_cache(out.trajectory.x_steps[s], names_filter=names)
        for n in names:
            assert torch.equal(out.cache[s][n], ref[n]), (s, n)  # the same forward: bit-identical
    # the estimate is exact for hooks of fixed shape, with their own dtype (indices int64, weights fp32)
    stored = sum(out.cache[s][n].numel() * out.cache[s][n].element_size() for s in out.cache.steps for n in names)
    assert out.cache.estimated_bytes == stored
    assert out.cache[0]["blocks.1.mlp.hook_expert_indices"].dtype == torch.long


@pytest.mark.parametrize("kind, kw", [("llada2", dict(gen_length=8, block_length=4, steps=2)),
                                      ("sdar", dict(gen_length=8, block_length=4)),
                                      ("sdar_moe", dict(gen_length=8, block_length=4))])
def test_every_hook_of_the_2026_families_is_cacheable_with_an_upper_bound_estimate(kind, kw, tmp_path):
    model = _family(kind, tmp_path)
    names = [n for n in model.hook_dict if n.startswith("blocks.1.") and "hook_result" not in n]
    out = model.generate(torch.tensor([[3, 9, 4, 17, 8]]), cache=names, **kw)
    assert len(out.cache.steps) == out.n_steps
    stored = sum(t.numel() * t.element_size() for s in out.cache.steps for t in
                 (out.cache[s][n] for n in names if n in out.cache[s]))
    assert 0 < stored <= out.cache.estimated_bytes
    if kind != "sdar":
        assert out.cache[0]["blocks.1.mlp.hook_expert_indices"].shape[-1] == model.blocks[1].mlp.top_k


def test_a_cache_past_the_budget_is_refused_for_measured_hooks_too(tmp_path):
    from mdm_lens import TrajectoryCache
    from mdm_lens.errors import MemoryBudgetError

    model = _family("lladamoe", tmp_path)
    with pytest.raises(MemoryBudgetError, match="budget"):
        model.generate(PROMPT, steps=2, gen_length=2,
                       cache=TrajectoryCache("blocks.1.mlp.hook_expert_indices", budget_bytes=100))


# --- C1: a reducer reused across generate calls ---------------------------------------------------------------------
@pytest.mark.parametrize("make, keys", [(ReceivedAttention, ["received_attention"]),
                                        (lambda: TopKKeys(k=2), ["topk_attention", "topk_keys"]),
                                        (KeyValueNorms, ["key_norms", "value_norms"])])
def test_a_reused_reducer_lists_each_runs_own_steps(tiny, make, keys):
    reducer = make()
    o1 = tiny.generate(PROMPT, record=[reducer])
    o2 = tiny.generate(torch.tensor([[9, 10]]), record=[reducer], gen_length=8, steps=8)
    fresh = tiny.generate(torch.tensor([[9, 10]]), record=[make()], gen_length=8, steps=8)
    assert sorted(o2.record_meta) == sorted(keys)
    for k in keys:
        assert o1.record_meta[k]["steps"] == [0, 1, 2, 3]
        assert o2.record_meta[k]["steps"] == list(range(8)) == fresh.record_meta[k]["steps"]
        assert torch.equal(torch.nan_to_num(o2.records[k].float(), -7.0), torch.nan_to_num(fresh.records[k].float(), -7.0))


def test_the_readers_of_a_reused_reducers_run_match_a_fresh_run(tiny):
    from mdm_lens.probes.run import anchors_over_steps, drift_from_output
    from mdm_lens.views import explore

    r = [ReceivedAttention()]
    tiny.generate(PROMPT, record=r)
    o2 = tiny.generate(torch.tensor([[9, 10]]), record=r, gen_length=8, steps=8)
    fresh = tiny.generate(torch.tensor([[9, 10]]), record=[ReceivedAttention()], gen_length=8, steps=8)
    a, b = anchors_over_steps(o2, layer=0), anchors_over_steps(fresh, layer=0)
    assert torch.equal(a.anchors, b.anchors) and a.anchors.shape[-2] == 8
    d2, df = drift_from_output(o2, layer=0), drift_from_output(fresh, layer=0)
    assert _same(d2, df)
    assert explore(o2, tiny).data[0]["steps"] == explore(fresh, tiny).data[0]["steps"] == list(range(8))


def _same(a, b) -> bool:
    """Equal results (tensors NaN-aware, dataclass fields recursively)."""
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(torch.nan_to_num(a.double(), -7.0), torch.nan_to_num(b.double(), -7.0)))
    if dataclasses.is_dataclass(a):
        return all(_same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if hasattr(a, "equals"):
        return bool(a.equals(b))
    return a == b


def test_a_record_whose_meta_steps_do_not_match_its_rows_is_refused(tiny):
    from mdm_lens.probes.run import anchors_over_steps
    from mdm_lens.views import explore

    out = tiny.generate(PROMPT, record=[ReceivedAttention()])
    out.record_meta["received_attention"] = dict(out.record_meta["received_attention"], steps=[0, 1, 2, 3, 0, 1])
    for call in (lambda: anchors_over_steps(out, layer=0), lambda: explore(out, tiny)):
        with pytest.raises(InputError, match="4 step row") as e:
            call()
        assert e.value.argument == "out"


# --- C2: knockout's anchor pre-pass on KV-cached windows is the forward being cut ----------------------------------
def _prepass_anchors_equal_the_clean_forward(model, prompt, step, layers, **kw):
    from mdm_lens.probes._causal import anchor_mask_from_scores
    from mdm_lens.probes._knockout_hooks import KnockoutHooks

    names = [f"blocks.{l}.attn.hook_attn_scores" for l in layers]
    clean = model.generate(prompt, cache=names @ steps(step), **kw)
    ko = KnockoutHooks(model, layers, targets="anchors", prompt_length=prompt.shape[1])
    model.generate(prompt, fwd_hooks=ko.step_hooks([step]), **kw)
    for l, n in zip(layers, names):
        want = anchor_mask_from_scores(clean.cache[step][n], "zscore", False)[0]
        assert torch.equal(ko._anchors[l], want), l
    return clean, ko


@pytest.mark.parametrize("kw, step", [(dict(kv_cache="dual", gen_length=4, block_length=2, steps=4), 1),
                                      (dict(kv_cache="prefix", gen_length=4, block_length=2, steps=4), 3),
                                      (dict(sampler="dream", kv_cache="prefix", gen_length=4, block_length=2), 1)])
def test_knockout_prepass_on_kv_cache_windows_is_the_window_forward(tiny, kw, step):
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10]])
    _, ko = _prepass_anchors_equal_the_clean_forward(tiny, prompt, step, [0, 1], **kw)
    # the cut is the anchors the pre-pass found (head-mean keys removed per row = anchors per item)
    assert ko.n_knocked[0] == pytest.approx(float(ko._anchors[0].sum(-1).float().mean()), abs=1e-6) or \
        bool((ko._anchors[0].sum(-1) == 0).all())


@pytest.mark.parametrize("kw", [dict(kv_cache="dual", gen_length=4, block_length=2),
                                dict(kv_cache="prefix", gen_length=4, block_length=2, steps=[1]),
                                dict(sampler="dream", kv_cache="prefix", gen_length=4, block_length=2)])
def test_knockout_runs_on_kv_cache_runs(tiny, kw):
    from mdm_lens.probes import patching as PT

    res = PT.knockout(tiny, torch.tensor([[5, 6, 7, 8, 9, 10]]), n_random=1, **kw)
    assert res.conditions == ["clean", "anchors", "random"]
    assert torch.isfinite(res.value).all() and float(res.effect[0]) == 0.0


def test_knockout_prepass_on_nemotron_is_the_forward_being_cut(tmp_path):
    model = HookedMDM.from_pretrained(str(write_nemotron(tmp_path / "n")[0]))
    prompt = torch.tensor([[3, 9, 4, 17, 8, 11]])
    for step in (0, 2):  # the causal prefill, a denoising window against the cache
        _prepass_anchors_equal_the_clean_forward(model, prompt, step, [0, 1], gen_length=8, block_length=4)


def test_knockout_refuses_samplers_it_cannot_grid_before_generating(tiny, tmp_path):
    from mdm_lens.probes import patching as PT

    with pytest.raises(SamplerConfigError, match="no fixed number of steps") as e:
        PT.knockout(tiny, PROMPT, sampler="fastdllm_v2")
    assert e.value.argument == "sampler" and e.value.value == "fastdllm_v2"
    nem = HookedMDM.from_pretrained(str(write_nemotron(tmp_path / "n")[0]))
    # nemotron is gridded by its denoising forwards (probes.knockout_windowed), no longer refused
    res = PT.knockout(nem, torch.tensor([[3, 9, 4]]), gen_length=8, block_length=4, n_random=0)
    assert res.steps == list(range(8)) and "step k = the k-th 'denoise' forward" in res.notes[0]


# --- U2: a default the caller never passed is not blamed on the caller ---------------------------------------------
def test_a_conflicting_default_says_it_was_not_passed(tiny):
    with pytest.raises(SamplerConfigError) as e:
        tiny.generate(PROMPT, sampler="fastdllm_v2", block_size=2, max_new_tokens=4)
    assert e.value.argument == "small_block_size" and e.value.value == 8
    assert "You did not pass small_block_size: its default is 8" in str(e.value)
    with pytest.raises(SamplerConfigError) as e:  # passed: the plain message
        tiny.generate(PROMPT, sampler="fastdllm_v2", block_size=2, small_block_size=8, max_new_tokens=4)
    assert e.value.argument == "small_block_size" and "did not pass" not in str(e.value)


def test_a_conflicting_checkpoint_value_says_where_it_comes_from():
    model = HookedMDM.from_config(MDMConfig(d_model=32, n_layers=1, n_heads=4, d_mlp=48, d_vocab=50, mask_token_id=49,
                                            logit_shift=True, extra={"block_length": 3}), seed=0, init_std=0.2)
    with pytest.raises(SamplerConfigError) as e:
        model.generate(PROMPT, sampler="fastdllm_v2", small_block_size=1, max_new_tokens=6)
    assert e.value.argument == "block_size" and e.value.value == 3
    assert "it took 3, the checkpoint's value (model.cfg) or else the sampler's own default" in str(e.value)


# --- U3: a bad block length in a saved config is refused at load, naming the key ----------------------------------
@pytest.mark.parametrize("key, value", [("block_length", 0), ("block_length", "4"), ("block_length", 4.0),
                                        ("block_length", -2), ("block_length", True), ("gen_length", 0)])
def test_a_bad_extra_int_in_a_native_checkpoint_is_a_config_error_at_load(tiny, tmp_path, key, value):
    from mdm_lens.loading import save_pretrained

    folder = save_pretrained(tiny, tmp_path / "m")
    raw = json.loads((Path(folder) / "config.json").read_text())
    raw["attention"], raw["extra"] = "block_causal", dict(raw.get("extra") or {}, **{key: value})
    (Path(folder) / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=f"extra.{key}=") as e:
        HookedMDM.from_pretrained(str(folder))
    assert "config.json" in str(e.value)


@pytest.mark.parametrize("value", [0, "4", 4.0, -2])
def test_a_bad_block_length_in_from_config_is_a_config_error(value):
    base = MDMConfig(d_model=32, n_layers=1, n_heads=4, d_mlp=48, d_vocab=50, mask_token_id=49, attention="block_causal")
    with pytest.raises(ConfigError, match="extra.block_length="):
        dataclasses.replace(base, extra={"block_length": value})
    ok = dataclasses.replace(base, extra={"block_length": 4})
    assert HookedMDM.from_config(ok, seed=0).cfg.extra["block_length"] == 4


def test_the_bridges_own_hooks_are_cacheable_too():
    """DiffusionGemma (encoder-decoder) through the bridge: its MoE and norm-output hooks are measured by a probe
    pass with the ids as prompt and canvas; the estimate bounds what the run stores."""
    from mdm_lens.bridge import TransformersBridge
    from mdm_lens.bridge.tiny import tiny_diffusion_gemma
    from mdm_lens.hooks.memory import is_dense_hook

    bridge = TransformersBridge(tiny_diffusion_gemma(seed=1))
    names = [n for n in bridge.hook_dict if n.startswith("blocks.1.") and not is_dense_hook(n)]
    assert "blocks.1.mlp.hook_expert_indices" in names
    ids = torch.randint(2, 128, (2, 5), generator=torch.Generator().manual_seed(0))
    out = bridge.generate(ids, seed=3, max_new_tokens=8, max_denoising_steps=2, cache=names @ steps(1))
    stored = sum(t.numel() * t.element_size() for t in out.cache[1].values())
    assert set(out.cache[1]) == set(names) and 0 < stored <= out.cache.estimated_bytes
