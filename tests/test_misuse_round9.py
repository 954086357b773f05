"""Held-out misuse13 findings (each test fails on the behaviour the audit met): SDAR anchors over keys a forward
never had, knockout's forwards_cut counting uncut forwards, LLaDA2 router keys the reference ignores, a config.json
that is not an object, step-range errors on runs of unknown length, 'auto' in the sampler choices, empty export
data."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from mdm_lens import HookedMDM, ReceivedAttention
from mdm_lens.errors import ConfigError, InputError, SamplerConfigError


def _no_mask(model):
    """The mask column pinned very low: a random block model would otherwise sample the mask id."""
    def hook(module, args, out):
        out = out.clone()
        out[..., model.cfg.mask_token_id] = -1e4
        return out
    return model.unembed.register_forward_hook(hook)


@pytest.fixture(scope="module")
def sdar(tmp_path_factory):
    from tests.families.family_checkpoints import write_sdar

    return HookedMDM.from_pretrained(str(write_sdar(tmp_path_factory.mktemp("sdar"))[0]), load_tokenizer=False)


# --- S1: keys a step's forward did not have are NaN in the record and invisible to the probes ---------------------

def test_sdar_anchors_see_only_the_keys_each_forward_had(sdar):
    from mdm_lens.probes import floating as F
    from mdm_lens.probes import run as R

    handle = _no_mask(sdar)
    try:
        out = sdar.generate([[5, 17, 33, 2, 61, 40, 9, 12, 44, 3]], gen_length=8, seed=0,
                            record=[ReceivedAttention()])
    finally:
        handle.remove()
    rec = out.records["received_attention"]                   # [step, batch, layer, head, key]
    sa = R.anchors_over_steps(out, layer=0, head="each")
    total = out.tokens.shape[1]
    checked = 0
    for s in range(out.n_steps):
        n = int(out.state_at(s).extra["query_end"])           # the forward's keys: [0, n)
        assert rec[s, :, :, :, n:].isnan().all() and not rec[s, :, :, :, :n].isnan().any()
        m = min(n, total)  # the probes keep prompt + gen_length keys (the last block's canvas tail is no answer)
        assert sa.key_visible[0, s, :m].all() and not sa.key_visible[0, s, m:].any()
        for h in range(rec.shape[3]):
            want = F.detect_anchors(rec[s, 0, 0, h, :m].double())
            assert torch.equal(sa.anchors[0, h, s, :m], want) and not sa.anchors[0, h, s, m:].any()
        checked += n < total
    assert checked > 0  # some step's forward lacked later keys


# --- S2: forwards_cut counts forwards where a key was removed ----------------------------------------------------

def test_forwards_cut_counts_only_forwards_that_removed_a_key():
    from mdm_lens.probes import _knockout_hooks as KH
    from mdm_lens.probes.knockout_bd import cut_forwards

    class Ko:
        knocked_by_step = {0: [0.0, 0.0], 3: [0.0, 1.5], 4: [2.0, 0.0], 7: [0.0]}

    assert cut_forwards(Ko()) == 2 and cut_forwards(None) == 0
    assert hasattr(KH.KnockoutHooks, "step_hooks")


def test_bd3lm_cached_knockout_reports_no_cut_forward_when_it_cut_nothing(tmp_path):
    from mdm_lens.probes import patching as PT
    from tests.families.bd3gidd_checkpoints import BD3LM_CONFIG, write_bd3lm

    warnings.simplefilter("ignore")
    bd = HookedMDM.from_pretrained(str(write_bd3lm(tmp_path / "b", dict(BD3LM_CONFIG, model_length=32))[0]),
                                   load_tokenizer=False)
    r = PT.knockout(bd, torch.tensor([3, 14, 15, 9]), steps=[0, 1, 2, 3], gen_length=8, kv_cache=True)
    table = r.table()
    for i, name in enumerate(("clean", "anchors", "random")):
        n_targets = r.n_targets[i]
        cut_any = bool((torch.nan_to_num(n_targets) > 0).any())
        assert (float(r.forwards_cut[i]) > 0) == cut_any, (name, r.forwards_cut.tolist(), n_targets.tolist())
        if not cut_any and name != "clean":
            assert "nothing cut" in table.loc[name, "note"]
    t = PT.knockout(bd, torch.tensor([3, 14, 15, 9]), targets=[0, 1, 2, 3], steps=[0, 1], gen_length=8, kv_cache=True)
    assert float(t.forwards_cut[1]) == 2  # explicit targets cut both chosen forwards


# --- S3 / S4: LLaDA2 router keys the reference never reads ---------------------------------------------------------

LLADA2 = dict(architectures=["LLaDA2MoeModelLM"], model_type="llada2_moe", vocab_size=64, hidden_size=32,
              num_attention_heads=4, num_hidden_layers=2, max_position_embeddings=256, num_key_value_heads=2,
              intermediate_size=64, moe_intermediate_size=16, num_experts=8, num_shared_experts=1,
              num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1, mask_token_id=63)


def _llada2(tmp_path, **over):
    from mdm_lens.loading import read_config

    folder = tmp_path / ("_".join(f"{k}{v}" for k, v in over.items()) or "plain")
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**LLADA2, **over}))
    return read_config(folder, "llada2", None)[0]


@pytest.mark.parametrize("over", [dict(score_function="softmax"), dict(moe_router_enable_expert_bias=False)])
def test_llada2_router_keys_the_reference_ignores_load_as_it_runs_them_with_a_warning(tmp_path, over):
    from mdm_lens.loading.rnd1 import ReferenceConfigWarning

    plain = _llada2(tmp_path)
    with pytest.warns(ReferenceConfigWarning, match=f"{next(iter(over))}=.*ignores"):
        cfg = _llada2(tmp_path, **over)
    assert cfg.extra["moe"] == plain.extra["moe"]  # sigmoid scores, expert bias for selection: the reference's
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _llada2(tmp_path, score_function="sigmoid", moe_router_enable_expert_bias=True)  # what it runs: silent


@pytest.mark.parametrize("over", [dict(score_function="bogus"), dict(score_function=1),
                                  dict(moe_router_enable_expert_bias="no"), dict(moe_router_enable_expert_bias=0)])
def test_llada2_router_keys_with_invalid_values_are_refused(tmp_path, over):
    with pytest.raises(ConfigError, match=next(iter(over))):
        _llada2(tmp_path, **over)


# --- C1: a config.json that is not a JSON object -------------------------------------------------------------------

@pytest.mark.parametrize("text", ["[1, 2]", "3", "null", '"x"'])
def test_a_config_that_is_not_an_object_is_a_config_error_on_every_loader(tmp_path, text):
    from mdm_lens.ddit import HookedDDiT

    (tmp_path / "config.json").write_text(text)
    for load in (HookedMDM.from_pretrained, HookedDDiT.from_pretrained):
        with pytest.raises(ConfigError, match=r"config.json holds a \w+, not a JSON object"):
            load(str(tmp_path))


# --- U1: a step past a run of unknown length --------------------------------------------------------------------------

def test_a_step_past_an_adaptive_runs_bound_names_the_bound_not_a_run_length(sdar):
    hooks = [("blocks.0.hook_resid_pre", lambda x, hook: x)]
    with pytest.raises(SamplerConfigError) as err:
        sdar.generate([[5, 17, 33, 2, 61, 40, 9, 12]], gen_length=8, seed=0, fwd_hooks=hooks, hook_steps=[100])
    text = str(err.value)
    assert "at most" in text and "negative values count from the end" not in text and err.value.value == 100
    with pytest.raises(SamplerConfigError, match="counted from the end"):
        sdar.generate([[5, 17, 33, 2, 61, 40, 9, 12]], gen_length=8, seed=0, fwd_hooks=hooks, hook_steps=[-1])


# --- U2 / U3 --------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    return HookedMDM.from_pretrained("mdm-lens/tiny-mdm")


def test_the_sampler_choices_list_auto(tiny):
    with pytest.raises(SamplerConfigError, match="expected one of 'auto', 'arm'"):
        tiny.generate(torch.tensor([[5, 17, 33]]), sampler=None)


def test_export_of_no_prompts_says_the_list_is_empty(tiny, tmp_path):
    from mdm_lens.sae import export_activations

    with pytest.raises(InputError, match=r"data=\[\] is empty"):
        export_activations(tiny, [], "blocks.1.hook_resid_post", out=str(tmp_path / "a"), progress=False)
    assert not (tmp_path / "a").exists()
