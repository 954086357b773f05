"""Round eight (a): a `steps` the caller passes under a rule that decides the number of forwards itself (LLaDA /
Dream threshold, factor, EB) is refused whatever its value, also `steps == gen_length` (it was accepted and
ignored); the probes' own default (no `n_steps` given) is marked `DerivedSteps` and runs."""

from __future__ import annotations

import pytest
import torch

from mdm_lens import HookedMDM
from mdm_lens.diffusion.rules import DerivedSteps, derived_steps
from mdm_lens.errors import SamplerConfigError
from mdm_lens.probes.knockout import knockout


@pytest.fixture(scope="module")
def tiny():
    return HookedMDM.from_pretrained("mdm-lens/tiny-mdm")


@pytest.mark.parametrize("rule", [dict(threshold=0.9), dict(factor=1.0), dict(sampler_rule="eb")])
def test_llada_refuses_any_passed_steps_under_threshold_factor_or_eb(tiny, rule):
    p = tiny.to_tokens("The capital is")
    for steps in (8, 4):  # 8 == gen_length was accepted and ignored
        with pytest.raises(SamplerConfigError, match=rf"steps={steps} has no effect on sampler 'llada'") as err:
            tiny.generate(p, gen_length=8, steps=steps, **rule)
        assert err.value.argument == "steps"
    assert tiny.generate(p, gen_length=8, **rule).settings["steps"] == 8
    # a probe's own default (no n_steps given) is not the caller's steps: it runs, and an explicit one is refused
    assert knockout(tiny, p, gen_length=8, n_random=1, **rule).steps
    with pytest.raises(SamplerConfigError, match="steps=8 has no effect"):
        knockout(tiny, p, gen_length=8, n_steps=8, n_random=1, **rule)


def test_derived_steps_marks_only_the_fallback():
    assert derived_steps(5, 8) == 5 and type(derived_steps(5, 8)) is int
    d = derived_steps(None, 8)
    assert d == 8 and isinstance(d, DerivedSteps)


def test_a_plain_run_still_takes_steps_equal_to_gen_length(tiny):
    p = tiny.to_tokens("The capital is")
    out = tiny.generate(p, gen_length=8, steps=8)
    assert out.trajectory.n_steps == 8


def test_dream_refuses_a_passed_steps_equal_to_gen_length_under_threshold():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_sampler_reference import dream_model

    dream = dream_model()
    p = torch.tensor([[3, 4, 5]])
    with pytest.raises(SamplerConfigError, match="steps=8 has no effect on sampler 'dream'"):
        dream.generate(p, gen_length=8, steps=8, kv_cache="dual", block_length=4, threshold=0.5)
    assert dream.generate(p, gen_length=8, kv_cache="dual", block_length=4, threshold=0.5).settings["steps"] == 8


# --- KnockoutResult.to_frame says why a value is NaN (as the sweep's knockout.parquet did) -------------------------

NO_SLOT = "no gold answer position is still masked at this step"


def test_knockout_to_frame_notes_each_nan_row(tmp_path):
    from tests.families.family_checkpoints import write_llada2

    # token 31 is what these weights decode first: as EOS the run stops after its first block (3 forwards)
    m = HookedMDM.from_pretrained(str(write_llada2(tmp_path, eos_token_id=31)[0]), load_tokenizer=False)
    r = knockout(m, torch.tensor([[5, 6, 7, 8, 9]]), gen_length=8, block_length=4, n_random=1)
    assert r.steps == [0, 1, 2]
    df = r.to_frame()
    tf = df[df["metric"].isin(["tf_answer_logprob", "tf_answer_rank"])]
    # the one-token answer is committed at step 0: steps 1, 2 mask no answer slot
    assert tf.loc[tf["step"] > 0, "value"].isna().all() and tf.loc[tf["step"] > 0, "note"].str.startswith(NO_SLOT).all()
    assert tf.loc[tf["step"] == 0, "value"].notna().all() and (tf.loc[tf["step"] == 0, "note"] == "").all()
    acc = df[df["metric"] == "accuracy"]
    assert len(acc) == 3 and acc["note"].str.startswith("no answer was given").all()
    # every NaN row says why; rows with a value carry no note unless their condition has one
    assert (df.loc[df["value"].isna(), "note"] != "").all()
    # per-condition metrics only: no step column, notes still there
    only = r.to_frame(metrics=["accuracy", "value"])
    assert "step" not in only and (only.loc[only["metric"] == "accuracy", "note"] != "").all()
    assert list(r.table().index) == r.conditions


def test_knockout_to_frame_carries_the_condition_note(tiny):
    p = tiny.to_tokens("The capital is")
    # ten of eleven keys cut: the random control cannot be matched, its condition note says so on every row
    r = knockout(tiny, p, gen_length=8, targets=list(range(10)), n_random=1, answer="capital")
    assert r.condition_notes[2].startswith("unmatched control")
    df = r.to_frame()
    for cond, note in zip(r.conditions, r.condition_notes):
        got = df.loc[(df["condition"] == cond) & df["value"].notna(), "note"]
        assert (got == note).all()
    acc = df[df["metric"] == "accuracy"]
    assert acc["value"].notna().all() and not acc["note"].str.startswith("no answer").any()  # an answer was given


# --- the sweep on Fast-dLLM v2: LLaDA's length names map to its own (registry.own_lengths, as the SAE export) ------

def _fastdllm_sweep_model(tmp_path, n_items=1):
    import json
    import string
    import sys
    from pathlib import Path

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    sys.path.insert(0, str(Path(__file__).parent))
    sys.path.insert(0, str(Path(__file__).parent / "families"))
    from test_family_sweep import ITEMS
    from test_fastdllm_v2 import write_fastdllm_v2

    folder = write_fastdllm_v2(tmp_path / "ckpt")[0]
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(cfg, eos_token_id=95, pad_token_id=95)))
    chars = sorted(set(string.printable) - set("\t\n\r\x0b\x0c"))
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({"<|endoftext|>": 95, "|<MASK>|": 96})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.save(str(folder / "tokenizer.json"))
    data = tmp_path / "items.jsonl"
    data.write_text("".join(json.dumps(it) + "\n" for it in ITEMS[:n_items]))
    return HookedMDM.from_pretrained(str(folder)), data


def test_sweep_runs_a_fastdllm_v2_checkpoint(tmp_path):

    import pandas as pd

    from mdm_lens.sweep.runner import run

    import json

    model, data = _fastdllm_sweep_model(tmp_path, n_items=2)
    run(model, data, "accuracy,knockout,absorption", tmp_path / "sw", limit=2, gen_length=16, block_length=8,
        template="zoo", progress=False, batch_size=4)
    text = (tmp_path / "sw" / "manifest.json").read_text()
    assert '"max_new_tokens": 16' in text and '"block_size": 8' in text
    # one prompt per run: a batch's answer spans would count from its shortest prompt
    manifest = json.loads(text)
    assert manifest["arguments"]["batch_size"] == 1 and manifest["items_done"] == 2
    assert all(len(run_["prompt_lengths"]) == 1 for run_ in manifest["ran"]["sampler"])
    acc = pd.read_parquet(tmp_path / "sw" / "accuracy.parquet")
    assert len(acc) > 0
    ko = pd.read_parquet(tmp_path / "sw" / "knockout.parquet")
    assert ko["value"].isna().all() and ko["note"].str.contains("no fixed number of steps").all()
    assert pd.read_parquet(tmp_path / "sw" / "absorption.parquet")["value"].notna().any()
    with pytest.raises(SamplerConfigError, match="steps=4: sampler 'fastdllm_v2' has no such setting") as err:
        run(model, data, "accuracy", tmp_path / "sw2", limit=1, gen_length=16, steps=4, template="zoo",
            progress=False)
    assert err.value.argument == "steps"
    assert not (tmp_path / "sw2").exists()


@pytest.mark.parametrize("probe", ["retrieval", "flow", "atp"])
def test_sweep_refuses_the_probes_fastdllm_v2_cannot_give_before_writing(tmp_path, probe):
    from mdm_lens.sweep.runner import run

    model, data = _fastdllm_sweep_model(tmp_path)
    with pytest.raises(SamplerConfigError, match=rf"probes \['{probe}'\] cannot run on sampler 'fastdllm_v2'.*"
                                                 r"the others, \['accuracy'\], run") as err:
        run(model, data, f"accuracy,{probe}", tmp_path / "sw", limit=1, gen_length=16, block_length=8,
            template="zoo", progress=False)
    assert err.value.argument == "probes"
    assert not (tmp_path / "sw").exists()


# --- a block selection that fires nowhere warns after the run, naming each block's steps -----------------------

def _unfired(w):
    return [str(x.message) for x in w if "matched no forward of this run" in str(x.message)]


def test_a_block_selection_that_matches_no_forward_warns(tiny):
    import warnings

    from mdm_lens import ReceivedAttention
    from mdm_lens.hooks import at_steps, steps

    p = tiny.to_tokens("The capital is")
    fired = []
    for when, silent in ((steps(0, blocks=[1]), False), (steps(blocks=[1]), True), (steps(5, blocks=[1]), True)):
        fired.clear()
        hook = at_steps(lambda x, hook: fired.append(hook.name), when)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            out = tiny.generate(p, gen_length=8, steps=8, block_length=4, record=[ReceivedAttention(when=when)],
                                cache="blocks.0.hook_resid_post" @ when, fwd_hooks=[("blocks.0.hook_resid_post", hook)])
        got = _unfired(w)
        if silent:
            assert got == [] and fired and out.records["received_attention"].shape[0] > 0
        else:
            # step 0 is in block 0: the hook, the record and the cache each say so, with block 1's steps
            assert not fired and out.records["received_attention"].shape[0] == 0
            assert len(got) == 3 and all("blocks=[1]" in g and "{1: [4, 5, 6, 7]}" in g for g in got)
            assert {g.split(":")[0] for g in got} == {"fwd_hooks", "record 'received_attention'", "cache"}


def test_a_block_selection_on_an_adaptive_run_warns_with_the_runs_own_blocks(tmp_path):
    import warnings

    from mdm_lens import ReceivedAttention
    from mdm_lens.hooks import steps
    from tests.families.family_checkpoints import write_llada2

    m = HookedMDM.from_pretrained(str(write_llada2(tmp_path)[0]), load_tokenizer=False)
    prompt = torch.tensor([[5, 6, 7, 8, 9]])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = m.generate(prompt, gen_length=8, block_length=4, steps=8,
                         record=[ReceivedAttention(when=steps(blocks=[2]))])
    assert _unfired(w) == [] and out.records["received_attention"].shape[0] > 0
    block2 = out.record_meta["received_attention"]["steps"]  # the forwards LLaDA2 ran in block 2 (prompt block 0)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        m.generate(prompt, gen_length=8, block_length=4, steps=8, record=[ReceivedAttention(when=steps(0, blocks=[2]))])
    got = _unfired(w)
    assert len(got) == 1 and got[0].startswith("record 'received_attention'") and f"{{2: {block2}}}" in got[0]


def test_window_gold_scorer_reads_a_run_shorter_than_the_gold_canvas():
    # a knocked-out nemotron / bd3lm run that stopped earlier than the clean one: its commit steps are narrower than
    # the gold canvas; positions past its end were never committed (NaN), the others read their commit step's scores
    from mdm_lens.probes.knockout_windowed import WindowGoldScorer

    sc = WindowGoldScorer(None, torch.zeros(1, 6, dtype=torch.long))
    sc.lp = {0: torch.arange(6.0)[None], 2: 10 + torch.arange(6.0)[None]}
    sc.rank = {k: -v for k, v in sc.lp.items()}
    lp, rank = sc.at_commit(torch.tensor([[-1, 0, 2, 3]]))
    assert torch.equal(torch.isnan(lp), torch.tensor([[True, False, False, False, True, True]]))
    assert lp[0, 1:4].tolist() == [1.0, 12.0, 13.0] and rank[0, 1:4].tolist() == [-1.0, -12.0, -13.0]


# --- memory_plan's requested caches are sized for the run generate makes (misuse10 F1) --------------------------

def _cached_bytes(out):
    return sum(out.cache[k][n].numel() * out.cache[k][n].element_size() for k in out.cache.steps
               for n in out.cache[k].keys())


def _plan_and_run(m, prompt, **kw):
    plan = m.memory_plan(prompt, cache="blocks.*.hook_resid_post", **kw)
    out = m.generate(prompt, cache="blocks.*.hook_resid_post", seed=0, **kw)
    return plan, out


def test_memory_plan_sizes_requested_caches_for_the_runs_forwards(tmp_path):
    import warnings

    from mdm_lens.ddit import HookedDDiT, ddit_config
    from tests.families.bd3gidd_checkpoints import BD3LM_CONFIG, write_bd3lm
    from tests.families.family_checkpoints import write_llada2

    warnings.simplefilter("ignore")
    l2 = HookedMDM.from_pretrained(str(write_llada2(tmp_path / "l2")[0]), load_tokenizer=False)
    bd = HookedMDM.from_pretrained(str(write_bd3lm(tmp_path / "bd", dict(BD3LM_CONFIG, model_length=32))[0]),
                                   load_tokenizer=False)
    cfg = ddit_config("mdlm", d_vocab=40, n_ctx=16, d_model=32, cond_dim=16, n_layers=2, n_heads=2,
                      time_conditioning=False)
    mdlm = HookedDDiT.from_config(cfg, seed=0)
    cases = [(l2, torch.tensor([[5, 17, 33, 2, 61, 40]]), dict(gen_length=16, block_length=4, steps=4), 5 * 4),
             # 10 blocks of 4 over whole windows; block 0 holds 3 generated positions (first hitting: 3 steps)
             (bd, torch.tensor([[1]]), dict(gen_length=39, steps=4), 3 + 9 * 4),
             (mdlm, torch.tensor([[1]]), dict(gen_length=10, steps=4), 5)]     # + the noise-removal forward
    for m, prompt, kw, forwards in cases:
        plan, out = _plan_and_run(m, prompt, **kw)
        assert plan.forwards == forwards and out.n_steps <= forwards, (m.cfg.family, plan.forwards, out.n_steps)
        # an upper bound of what the run caches (the steps setting alone under-counted 1.2x to 5x)
        assert plan.rows["cpu"].caches >= _cached_bytes(out) > 0, m.cfg.family
        assert f"forwards={forwards}" in repr(plan) or forwards == plan.steps
    # MDLM: every planned forward ran, and the cache bound is the run's own estimate plus the trajectory
    plan, out = _plan_and_run(mdlm, torch.tensor([[1]]), gen_length=10, steps=4)
    assert out.n_steps == 5 and len(out.cache.steps) == 5


# --- misuse10 F2-F4 --------------------------------------------------------------------------------------------

def test_negative_layer_counts_from_the_models_layers_not_the_recorded_ones(tiny):
    from mdm_lens import ReceivedAttention
    from mdm_lens.errors import OutOfRangeError
    from mdm_lens.probes import run as R

    p = tiny.to_tokens("The capital is")
    part = tiny.generate(p, gen_length=8, steps=8, record=[ReceivedAttention(layers=[2])])
    for fn in (R.drift_from_output, R.anchors_over_steps):
        with pytest.raises(OutOfRangeError, match=r"layer=-1 \(model layer 3\) is invalid: it was not recorded"):
            fn(part, layer=-1)
    # -2 is layer 2, which was recorded: the same numbers as asking for it by number
    a, b = R.drift_from_output(part, layer=-2), R.drift_from_output(part, layer=2)
    torch.testing.assert_close(a.persistence, b.persistence, equal_nan=True)
    full = tiny.generate(p, gen_length=8, steps=8, record=[ReceivedAttention()])
    torch.testing.assert_close(R.drift_from_output(full, layer=-1).persistence,
                               R.drift_from_output(full, layer=3).persistence,
                               equal_nan=True)


def test_detect_anchors_refuses_negative_received_attention():
    from mdm_lens.errors import ArgumentError
    from mdm_lens.probes import floating as F

    with pytest.raises(ArgumentError, match="received has negative entries") as err:
        F.detect_anchors(torch.tensor([0.5, -0.5, 1.0]))
    assert err.value.argument == "received"
    # an invisible negative key is not read; a visible mass still gives its anchor
    assert F.detect_anchors(torch.tensor([0.1, -1.0, 5.0, 0.1, 0.1, 0.1, 0.1, 0.1]),
                            key_visible=torch.tensor([1, 0, 1, 1, 1, 1, 1, 1]).bool()).tolist() == \
        [False, False, True, False, False, False, False, False]


def test_indel_has_a_memory_plan_and_runs_on_a_max_memory_load(tmp_path):
    from tests.families.family_checkpoints import write_llada2

    folder, _, _ = write_llada2(tmp_path / "llada2-edit", delete_token_id=96, split_token_id=97, block_length=8)
    prompt = torch.tensor([[3, 11, 5, 20, 6]])
    kw = dict(gen_length=8, block_length=8, sampler="indel")
    model = HookedMDM.from_pretrained(str(folder))
    plan = model.memory_plan(prompt, **kw)  # was an AttributeError (no temperature on InDel's settings)
    assert plan.rows["cpu"].activations > 0 and plan.fits
    placed = HookedMDM.from_pretrained(str(folder), device_map="auto", max_memory={"cpu": "20GiB"})
    assert torch.equal(placed.generate(prompt, **kw).tokens, model.generate(prompt, **kw).tokens)


def test_masked_canvas_selects_query_rows_of_patterns_and_refuses_other_layouts(tiny):
    from mdm_lens.errors import InputError
    from mdm_lens.sae.canvas import MaskedCanvas

    toks = tiny.to_tokens(["the capital of the is the"] * 2)
    mc = MaskedCanvas(tiny, mask_rate=0.5, positions="masked", seed=0)
    out, acts = mc.run_with_cache(toks)  # every hook (no names_filter) was an IndexError
    masked = mc.last_masked
    b, q = torch.nonzero(masked, as_tuple=True)
    _, cache = tiny.run_with_cache(toks.masked_fill(masked, tiny.cfg.mask_token_id))
    n = int(masked.sum())
    assert n > 0 and out.shape == (1, n, tiny.cfg.d_vocab)
    pat = acts["blocks.1.attn.hook_pattern"]
    assert pat.shape == (1, n, tiny.cfg.n_heads, toks.shape[1])
    torch.testing.assert_close(pat[0], cache["blocks.1.attn.hook_pattern"][b, :, q, :], atol=1e-6, rtol=0)
    torch.testing.assert_close(acts["blocks.1.hook_resid_post"][0], cache["blocks.1.hook_resid_post"][b, q],
                               atol=1e-5, rtol=0)
    un = MaskedCanvas(tiny, mask_rate=0.5, positions="unmasked", seed=0)
    _, acts_u = un.run_with_cache(toks, names_filter=["blocks.0.attn.hook_pattern"])
    assert acts_u["blocks.0.attn.hook_pattern"].shape[1] == int((~un.last_masked).sum())
    with pytest.raises(InputError, match="no \\[batch, pos\\] leading axes") as err:
        mc._select(torch.zeros(3), masked, "hook_x")
    assert err.value.argument == "names_filter"


def test_windowed_knockout_says_the_true_reason_for_its_nan_teacher_forced_metrics(tmp_path):
    from tests.families.bd3gidd_checkpoints import BD3LM_CONFIG, write_bd3lm

    bd = HookedMDM.from_pretrained(str(write_bd3lm(tmp_path / "b", dict(BD3LM_CONFIG, model_length=32))[0]),
                                   load_tokenizer=False)
    p = torch.full((1, 4), 7)  # a whole block: kv_cache takes it
    plain = knockout(bd, p, gen_length=8, n_steps=4, n_random=1, seed=0)
    cached = knockout(bd, p, gen_length=8, n_steps=4, n_random=1, seed=0, kv_cache=True)
    why = [n for n in plain.notes if n.startswith("teacher-forced metrics")]
    why_kv = [n for n in cached.notes if n.startswith("teacher-forced metrics")]
    assert len(why) == 1 and "not built for BD3LM" in why[0] and "KV" not in why[0]
    assert len(why_kv) == 1 and "kv_cache forwards read the stored keys" in why_kv[0]
    df = plain.to_frame()
    tf = df[df["metric"] == "tf_answer_logprob"]
    assert tf["value"].isna().all() and (tf["note"] == why[0]).all()


def test_bd3lm_block_selections_are_checked_against_this_prompts_layout(tmp_path):
    from mdm_lens import ReceivedAttention
    from mdm_lens.hooks import steps
    from tests.families.bd3gidd_checkpoints import BD3LM_CONFIG, write_bd3lm

    bd = HookedMDM.from_pretrained(str(write_bd3lm(tmp_path / "b", dict(BD3LM_CONFIG, model_length=32))[0]),
                                   load_tokenizer=False)
    p = torch.tensor([[1]])  # 1 + 15 tokens = 4 blocks of 4 (the prompt-free bound said 5)
    with pytest.raises(SamplerConfigError, match=r"blocks\[0\]=4 does not exist: this run has 4 block\(s\)"):
        bd.generate(p, gen_length=15, steps=4, seed=0, record=[ReceivedAttention(when=steps(blocks=[4]))])
    out = bd.generate(p, gen_length=15, steps=4, seed=0, record=[ReceivedAttention(when=steps(blocks=[3]))])
    assert out.record_meta["received_attention"]["steps"] == [out.n_steps - 4 + i for i in range(4)]
    assert bd.memory_plan(p, gen_length=15, steps=4).forwards == 3 + 3 * 4 == out.n_steps  # first hitting: exact


def test_balanced_device_maps_take_a_disk_budget(tmp_path, tiny):
    # accelerate's balancing calls torch.device on every max_memory key: "disk" crashed there (misuse10 F8)
    kw = dict(max_memory={"cpu": "1MiB", "disk": "1GiB"})
    auto = HookedMDM.from_pretrained("mdm-lens/tiny-mdm", device_map="auto", offload_folder=str(tmp_path / "a"), **kw)
    seq = HookedMDM.from_pretrained("mdm-lens/tiny-mdm", device_map="sequential", offload_folder=str(tmp_path / "s"),
                                    **kw)
    assert "disk" in set(auto.hf_device_map.values()) and auto.hf_device_map == seq.hf_device_map
    toks = tiny.to_tokens("The capital is")
    torch.testing.assert_close(auto(toks), tiny(toks), atol=1e-5, rtol=0)


def test_cache_effect_on_sdar_names_its_exact_block_cache(tmp_path):
    from mdm_lens.errors import InputError
    from mdm_lens.probes.cache_effect import cache_effect
    from tests.families.family_checkpoints import write_sdar

    sd = HookedMDM.from_pretrained(str(write_sdar(tmp_path)[0]), load_tokenizer=False)
    out = sd.generate(torch.tensor([[5, 17, 33]]), gen_length=8, block_length=4, seed=0)
    with pytest.raises(InputError, match="'sdar' run decodes against its own exact KV cache") as err:
        cache_effect(sd, out)
    assert "has no KV cache" not in str(err.value)


def test_neuron_helpers_on_moe_layers_say_neurons_are_per_expert(tmp_path):
    from mdm_lens.errors import ArgumentError
    from tests.families.family_checkpoints import write_llada2

    m = HookedMDM.from_pretrained(str(write_llada2(tmp_path)[0]), load_tokenizer=False)
    moe = m.cfg.extra["moe_layers"]
    first = moe.index(True)
    assert first >= 1 and not any(moe[:first])  # a dense layer before the first MoE one
    m.set_use_attn_result(True)
    _, cache = m.run_with_cache(torch.tensor([[5, 6, 7, 8]]))
    for call in (lambda: cache.get_full_resid_decomposition(expand_neurons=True),
                 lambda: cache.stack_neuron_results(layer=first + 1),
                 lambda: cache.get_neuron_results(first)):
        with pytest.raises(ArgumentError, match=rf"neurons are not defined on MoE layer\(s\) \[{first}"):
            call()
    # the dense layers before it still give their neurons, and without neurons the decomposition runs
    stack = cache.stack_neuron_results(layer=first)
    assert stack.shape[0] == first * m.cfg.d_mlp
    cache.get_full_resid_decomposition(expand_neurons=False)


# --- misuse11: one meaning of "apply the norm" in every cache helper, and TL 4's cache.logit_lens refused ----------

def test_recomputed_norm_stacks_leave_the_weight_to_the_directions(tiny):
    toks = torch.randint(4, 300, (2, 8), generator=torch.Generator().manual_seed(0))
    logits, cache = tiny.run_with_cache(toks)
    d = tiny.tokens_to_residual_directions(torch.tensor([5, 5]))
    acc = cache.accumulated_resid(layer=-1, pos_slice=-1, apply_ln=True)
    raw = cache.accumulated_resid(layer=-1, pos_slice=-1)
    # the final entry dotted with the token's direction is its logit (tiny-mdm's final norm weight is far from 1)
    torch.testing.assert_close((acc[-1] * d).sum(-1), logits[:, -1, 5], atol=1e-4, rtol=0)
    dec = cache.decompose_resid(layer=-1, pos_slice=-1, apply_ln=True)
    torch.testing.assert_close(dec.sum(0), acc[-1], atol=1e-5, rtol=0)
    # each entry is its own residual over its own RMS, no weight (TL 4's recomputed statistics; TL 3 divides every
    # entry by the final scale, the same for the last entry)
    own = raw[-1] / (raw[-1].pow(2).mean(-1, keepdim=True) + tiny.cfg.norm_eps).sqrt()
    torch.testing.assert_close(acc[-1], own, atol=1e-5, rtol=0)
    import inspect

    from transformer_lens import ActivationCache

    if "recompute_ln" not in inspect.signature(ActivationCache.apply_ln_to_stack).parameters:
        return  # TransformerLens 3 has no recompute_ln
    rec = cache.apply_ln_to_stack(raw, layer=-1, pos_slice=-1, recompute_ln=True)
    mine = raw / (raw.pow(2).mean(-1, keepdim=True) + tiny.cfg.norm_eps).sqrt()
    torch.testing.assert_close(rec, mine, atol=1e-5, rtol=0)


def test_tl4_cache_logit_lens_is_refused_by_name(tiny):
    from mdm_lens.errors import UnsupportedAttributeError

    _, cache = tiny.run_with_cache(torch.randint(4, 300, (1, 8)))
    with pytest.raises(UnsupportedAttributeError, match="cache.logit_lens .* is not supported on a HookedMDM cache"):
        cache.logit_lens()


@pytest.mark.parametrize("rope", [None, dict(rope_type="default", llama_4_scaling_beta=0.1,
                                             original_max_position_embeddings=16, rope_theta=10000.0)])
def test_a_saved_nemotron_folder_loads_back_exactly(tmp_path, rope):
    # its yarn scaling / llama-4 query scale were written and then refused by the native reader (misuse11 F3)
    from mdm_lens.loading import save_pretrained
    from tests.families.nemotron_fixture import write_nemotron

    kw = {} if rope is None else dict(rope_parameters=rope)
    folder = write_nemotron(tmp_path / "n", **kw)[0]
    m = HookedMDM.from_pretrained(str(folder), load_tokenizer=False)
    scaling = m.cfg.extra["rope_scaling"]
    assert scaling["rope_type"] == ("yarn" if rope is None else "default")
    save_pretrained(m, tmp_path / "saved")
    back = HookedMDM.from_pretrained(str(tmp_path / "saved"), load_tokenizer=False)
    assert back.cfg.extra["rope_scaling"] == scaling
    toks = torch.randint(0, 90, (1, 24), generator=torch.Generator().manual_seed(0))  # past the 16 original positions
    assert torch.equal(back(toks), m(toks))


def test_a_stop_token_equal_to_the_mask_id_is_refused(tmp_path):
    # SDAR stopped after its first forward with a mask in the answer span (misuse11 F4); Fast-dLLM v2 the same class
    from tests.families.family_checkpoints import write_sdar
    from tests.test_fastdllm_v2 import write_fastdllm_v2

    sd = HookedMDM.from_pretrained(str(write_sdar(tmp_path / "s")[0]), load_tokenizer=False)
    mask = sd.cfg.mask_token_id
    with pytest.raises(SamplerConfigError, match=rf"cfg.mask_token_id={mask} and stopping_criteria_idx\[1\]={mask} "
                                                 "are the same token") as err:
        sd.generate(torch.tensor([[5, 6, 7]]), gen_length=12, block_length=4, stopping_criteria_idx=[3, mask])
    assert err.value.argument == "stopping_criteria_idx[1]"
    fd = HookedMDM.from_pretrained(str(write_fastdllm_v2(tmp_path / "f")[0]), load_tokenizer=False)
    with pytest.raises(SamplerConfigError, match=r"cfg.mask_token_id=\d+ and stop_token=\d+ are the same token") as err:
        fd.generate(torch.tensor([[5, 6, 7, 8, 9]]), max_new_tokens=8, small_block_size=2,
                    stop_token=fd.cfg.mask_token_id)
    assert err.value.argument == "stop_token"


@pytest.mark.parametrize("kind, tc, why", [("duo", True, "has no mask token"),
                                           ("mdlm", True, "is conditioned on it")])
def test_masked_canvas_refuses_models_it_cannot_noise_faithfully(kind, tc, why):
    # Duo crashed on the first call; a time-conditioned MDLM / GIDD ran masked canvases at the clean time (misuse11)
    from mdm_lens.ddit import HookedDDiT, ddit_config
    from mdm_lens.errors import InputError
    from mdm_lens.sae.canvas import MaskedCanvas

    cfg = ddit_config(kind, d_vocab=40, n_ctx=16, d_model=32, cond_dim=16, n_layers=2, n_heads=2, time_conditioning=tc)
    with pytest.raises(InputError, match=why) as err:
        MaskedCanvas(HookedDDiT.from_config(cfg, seed=0), mask_rate=0.5)
    assert err.value.argument == "model"
    plain = ddit_config("mdlm", d_vocab=40, n_ctx=16, d_model=32, cond_dim=16, n_layers=2, n_heads=2,
                        time_conditioning=False)
    MaskedCanvas(HookedDDiT.from_config(plain, seed=0), mask_rate=0.5)  # sigma is not read: the canvas is faithful


@pytest.mark.parametrize("strategy", ["balanced", "sequential"])
def test_a_disk_budget_the_placement_exceeds_is_refused_at_load(tmp_path, strategy):
    # accelerate treats disk as unlimited: the model loaded, then every run was refused (misuse11 F7)
    from mdm_lens.errors import ArgumentError

    with pytest.raises(ArgumentError, match=r"max_memory\['disk'\]=.* is exceeded: this placement puts \['blocks.1'"):
        HookedMDM.from_pretrained("mdm-lens/tiny-mdm", device_map=strategy, offload_folder=str(tmp_path / "o"),
                                  max_memory={"cpu": "2MiB", "disk": "1KiB"})
    ok = HookedMDM.from_pretrained("mdm-lens/tiny-mdm", device_map=strategy, offload_folder=str(tmp_path / "p"),
                                   max_memory={"cpu": "2MiB", "disk": "1GiB"})
    assert "disk" in set(ok.hf_device_map.values())
    ok.generate(torch.tensor([[5, 6, 7]]), steps=2, gen_length=2)  # the guard accepts what the load accepted


def test_step_selections_list_the_steps_they_fire_at(tiny):
    from mdm_lens.hooks import steps

    out = tiny.generate(tiny.to_tokens("The capital is"), steps=8, gen_length=8,
                        cache="blocks.0.hook_resid_post" @ steps(every=3))
    assert list(out.cache.steps) == out.cache.when.selected(8) == [0, 3, 6, 7]
    assert steps(1, 5, -1).selected(8) == [1, 5, 7] and steps().selected(3) == [0, 1, 2]
    assert steps(0, 6, every=3).selected(8) == [0, 6]
    with pytest.raises(SamplerConfigError, match="decided per block while the sampler runs"):
        steps(blocks=[1]).selected(8)


@pytest.mark.parametrize("key", ["fwd_hooks", "prompt", "record", "cache", "steps"])
def test_probes_refuse_generate_keywords_they_set_themselves(tiny, key):
    # raw "got multiple values" TypeErrors, or record= / cache= silently dropped (misuse12 C2, C3, S3)
    from mdm_lens.errors import ArgumentError
    from mdm_lens.probes import patching

    p = tiny.to_tokens("The capital is")
    value = {"fwd_hooks": [], "prompt": p, "record": [], "cache": "blocks.0.hook_resid_post", "steps": 4}[key]
    calls = [lambda: patching.patch_anchor_activations(tiny, p, p, step=0, gen_length=4, **{key: value})]
    if key != "steps":
        calls.append(lambda: knockout(tiny, p, gen_length=4, n_random=1, **{key: value}))
    for call in calls:
        with pytest.raises(ArgumentError, match=rf"\({key}=\.\.\.\): .* runs generate itself and sets {key}") as err:
            call()
        assert err.value.argument == key


def test_knockout_refuses_a_gold_answer_holding_the_mask_id(tiny):
    from mdm_lens.errors import InputError

    p = tiny.to_tokens("The capital is")
    mask = tiny.cfg.mask_token_id
    with pytest.raises(InputError, match=rf"holds the mask id {mask} at position\(s\) \[0\]") as err:
        knockout(tiny, p, answer=torch.tensor([mask, 5]), steps=[0], gen_length=8, n_random=1)
    assert err.value.argument == "answer"
    assert knockout(tiny, p, answer=torch.tensor([6, 5]), steps=[0], gen_length=8, n_random=1).conditions


def test_every_on_a_run_of_unknown_length_says_its_last_forward_was_not_hooked(tmp_path, tiny):
    import warnings

    from mdm_lens import ReceivedAttention
    from mdm_lens.hooks import steps
    from tests.families.family_checkpoints import write_llada2

    m = HookedMDM.from_pretrained(str(write_llada2(tmp_path)[0]), load_tokenizer=False)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = m.generate(torch.tensor([[5, 6, 7, 8, 9]]), gen_length=8, block_length=4, steps=8,
                         record=[ReceivedAttention(when=steps(every=3))])
    last = out.n_steps - 1
    assert last % 3 and last not in out.record_meta["received_attention"]["steps"]
    got = [str(x.message) for x in w if "steps(every=3)" in str(x.message)]
    assert len(got) == 1 and f"its last forward (step {last}) was not hooked" in got[0]
    # a run of known length includes its last step and says nothing
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        fixed = tiny.generate(tiny.to_tokens("The capital is"), gen_length=8, steps=8,
                              record=[ReceivedAttention(when=steps(every=3))])
    assert fixed.record_meta["received_attention"]["steps"] == [0, 3, 6, 7]
    assert not [x for x in w if "steps(every=" in str(x.message)]


@pytest.mark.parametrize("bad", [slice(None, None, -1), (0, 4, -2), slice(0, 4, 0)])
def test_cache_slices_need_a_positive_step(tiny, bad):
    from mdm_lens.errors import ArgumentError

    _, cache = tiny.run_with_cache(torch.randint(4, 300, (1, 8)))
    with pytest.raises(ArgumentError, match="TransformerLens slices take a positive step") as err:
        cache.accumulated_resid(pos_slice=bad)
    assert err.value.argument == "pos_slice"
    assert cache.accumulated_resid(pos_slice=slice(0, 8, 2)).shape[-2] == 4


def test_knockout_empty_steps_and_record_layer_messages(tiny):
    from mdm_lens import ReceivedAttention
    from mdm_lens.errors import ArgumentError, ArgumentTypeError
    from mdm_lens.probes import run as R

    p = tiny.to_tokens("The capital is")
    with pytest.raises(ArgumentError, match=r"steps=\[\] selects no step") as err:
        knockout(tiny, p, gen_length=4, steps=[])
    assert err.value.argument == "steps" and "1000000000" not in str(err.value)
    out = tiny.generate(p, gen_length=4, steps=4, record=[ReceivedAttention(layers=[1, 2])])
    with pytest.raises(ArgumentTypeError, match=r"expected an int layer in \[-4, 3\]"):  # the model's layers
        R.anchors_over_steps(out, layer="x")


def test_sdar_stop_ids_given_as_text_are_named_whole(tmp_path):
    from tests.families.family_checkpoints import write_sdar

    sd = HookedMDM.from_pretrained(str(write_sdar(tmp_path)[0]), load_tokenizer=False)
    from mdm_lens.errors import ArgumentError

    with pytest.raises(ArgumentError, match="stopping_criteria_idx='62' is invalid") as err:  # was its first char '6'
        sd.generate(torch.tensor([[5, 6, 7]]), gen_length=8, block_length=4, stopping_criteria_idx="62")
    assert err.value.argument == "stopping_criteria_idx"
