"""Held-out misuse run 28 (issue #32 §3): each test fails on the code before its fix."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "families"))

from family_checkpoints import write_sdar  # noqa: E402

from mdm_lens import HookedMDM, MDMConfig  # noqa: E402
from mdm_lens.diffusion.generate import plan  # noqa: E402
from mdm_lens.errors import OutOfRangeError, SamplerConfigError  # noqa: E402
from mdm_lens.nnsight import DiffusionLM, StepNotRunError  # noqa: E402

PROMPT = [[20, 21, 22, 23, 24, 25]]
RESID = "blocks.0.hook_resid_post"


@pytest.fixture(scope="module")
def sdar(tmp_path_factory):
    folder = write_sdar(tmp_path_factory.mktemp("m28") / "sdar")[0]
    cfg = HookedMDM.from_pretrained(str(folder), load_tokenizer=False).cfg
    return HookedMDM.from_config(cfg, seed=3, init_std=0.05, init="realistic")


def _dreamon() -> HookedMDM:
    cfg = MDMConfig(d_model=32, n_layers=2, n_heads=4, d_head=8, d_mlp=64, d_vocab=64, n_ctx=256,
                    attention="bidirectional", logit_shift=True, mask_token_id=63, eos_token_id=62, family="dream")
    model = HookedMDM.from_config(cfg, seed=0, init="realistic")
    model.cfg.extra["expand_token_id"] = 57
    return model


DREAMON = dict(sampler="dreamon", suffix=torch.tensor([[8, 9]]), steps=8)


def test_nnsight_a_step_past_the_end_of_a_run_without_a_plan_names_the_steps_it_had():
    """C1: DreamOn has no plan before its run; a step it never reached raised AttributeError inside the clock."""
    lm = DiffusionLM(_dreamon())
    with pytest.raises(StepNotRunError, match=r"step 50 was never reached: this run has \d+ denoising steps \(0\.\.\d+\)\."):
        with lm.generate(torch.tensor([[5, 6, 7]]), **DREAMON) as tracer:
            for _ in tracer.iter[50]:
                lm.blocks[0].hook_resid_post.output.save()


def test_nnsight_steps_of_a_run_without_a_plan_equal_the_step_cache():
    model = _dreamon()
    lm = DiffusionLM(model)
    saved: list = []
    with lm.generate(torch.tensor([[5, 6, 7]]), **DREAMON) as tracer:
        for _ in tracer.iter[[0, 2]]:
            saved.append(lm.blocks[0].hook_resid_post.output.save())
    out = model.generate(torch.tensor([[5, 6, 7]]), cache=RESID, **DREAMON)
    for got, k in zip(saved, (0, 2)):
        torch.testing.assert_close(got, out.cache[k][RESID])


@pytest.mark.parametrize("key", [-1, [0, -1], slice(-2, None), slice(0, -1)])
def test_nnsight_steps_from_the_end_are_refused_on_adaptive_runs_as_generate_refuses_them(sdar, key):
    """U1: SDAR stops a block when it holds no mask: -1 was resolved against the planned bound (then 'step 15 was
    never reached'), and on DreamOn it was nnsight's bare ValueError."""
    for model, kw in ((sdar, dict(gen_length=8, block_length=4, steps=4)), (_dreamon(), DREAMON)):
        with pytest.raises(SamplerConfigError, match="counted from the end are ambiguous here") as err:
            with DiffusionLM(model).generate(torch.tensor(PROMPT), **kw) as tracer:
                for _ in tracer.iter[key]:
                    pass
        assert err.value.argument.startswith("tracer.iter")


def test_nnsight_an_adaptive_runs_bound_is_named_without_negatives(sdar):
    lm = DiffusionLM(sdar)
    bound = plan(sdar, sampler="sdar", gen_length=8, block_length=4, steps=4).n_steps
    with pytest.raises(OutOfRangeError, match=rf"tracer\.iter.*expected an int <= {bound - 1}") as err:
        with lm.generate(torch.tensor(PROMPT), gen_length=8, block_length=4, steps=4) as tracer:
            for _ in tracer.iter[bound]:
                pass
    assert f"-{bound}" not in str(err.value)
    seen: list = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an open loop ends with the run
        with lm.generate(torch.tensor(PROMPT), gen_length=8, block_length=4, steps=4) as tracer:
            for _ in tracer.iter[2:]:
                seen.append(lm.blocks[0].hook_resid_post.output.save())
    assert len(seen) >= 1


def test_cache_effect_on_fastdllm_v2_gives_advice_that_sampler_can_follow(tmp_path):
    """U3: the refusal advised a kv_cache=False run, a setting Fast-dLLM v2 refuses."""
    from test_fastdllm_v2 import write_fastdllm_v2

    from mdm_lens.errors import InputError
    from mdm_lens.probes.cache_effect import cache_effect

    model = HookedMDM.from_pretrained(str(write_fastdllm_v2(tmp_path / "v2")[0]), load_tokenizer=False)
    kw = dict(block_size=4, small_block_size=2, max_new_tokens=8, stop_token=95, pad_id=0)
    for block_cache, says in ((False, "its own exact KV cache of finished blocks"),
                              (True, "compare it with a use_block_cache=False run")):
        out = model.generate(torch.tensor([[30, 31, 32, 33, 34, 35]]), use_block_cache=block_cache, **kw)
        with pytest.raises(InputError, match=says) as err:
            cache_effect(model, out)
        assert "kv_cache=False" not in str(err.value)


def test_the_sweeps_cache_probe_on_coda_names_codas_reason_at_any_length():
    """U4: at gen_length 8 the reason blamed gen_length vs a block length CoDA does not have."""
    from types import SimpleNamespace

    from mdm_lens.sweep.cache_tables import _has_fast_dllm_cache, cache

    assert not _has_fast_dllm_cache("coda") and _has_fast_dllm_cache("dream") and _has_fast_dllm_cache("llada")
    table = cache(None, SimpleNamespace(item_ids=["a"]), None,
                  {"out": SimpleNamespace(causal=False, sampler="coda")})
    assert table.reason.str.contains("not applicable: .*CoDA's diffusion_generate has no cached block decoding").all()
    assert len(table) == 2 and table.value.isna().all()


def test_rnd1_pad_equal_to_the_mask_id_is_refused_at_load_and_the_sampler_names_the_checkpoints_value(tmp_path):
    """U2: accepted at load; the sampler then said 'its default is DEFAULT' and blamed gen_length."""
    from rnd1_coda_checkpoints import write_rnd1

    from family_checkpoints import MASK_ID

    from mdm_lens.errors import ConfigError

    with pytest.raises(ConfigError, match=r"pad_token_id=100 are the same token: .*config\.json: RND1"):
        HookedMDM.from_pretrained(str(write_rnd1(tmp_path / "bad", pad_token_id=MASK_ID)[0]), load_tokenizer=False)
    model = HookedMDM.from_pretrained(str(write_rnd1(tmp_path / "ok")[0]), load_tokenizer=False)
    model.cfg.pad_token_id = MASK_ID  # edited after load: the sampler's own check
    with pytest.raises(SamplerConfigError, match=r"it took 100, the checkpoint's value \(model\.cfg\.pad_token_id\)") as err:
        model.generate(torch.tensor([[5, 6, 7]]), gen_length=8)
    assert "DEFAULT" not in str(err.value) and "gen_length" not in str(err.value)


@pytest.mark.parametrize("family", ["mdlm", "duo", "bd3lm", "gidd"])
@pytest.mark.parametrize("value", [0, "eight", [4], float("nan"), True, 48])
def test_dit_loaders_refuse_a_mask_token_id_their_model_does_not_use(family, value):
    """S3: any config.json mask_token_id loaded, the mask always being the last id."""
    from mdm_lens.ddit.hub import bd3lm_config, gidd_config
    from mdm_lens.ddit.loading import config_from_ddit
    from mdm_lens.errors import ConfigError

    raw = {"mdlm": dict(vocab_size=50, model_length=32, hidden_dim=32, cond_dim=16, n_blocks=2, n_heads=4),
           "duo": dict(vocab_size=50, model_length=32, hidden_dim=32, cond_dim=16, n_blocks=2, n_heads=4),
           "bd3lm": dict(vocab_size=50, model_length=32, hidden_dim=32, cond_dim=16, n_blocks=2, n_heads=4,
                         block_size=4),
           "gidd": dict(vocab_size=50, max_seq_len=32, hidden_size=32, timestep_cond_dim=16, num_hidden_layers=2,
                        num_attention_heads=4)}[family]

    def load(r):
        if family in ("mdlm", "duo"):
            return config_from_ddit(r, family, "x", Path("config.json"))
        return (bd3lm_config if family == "bd3lm" else gidd_config)(r, "x", Path("config.json"))

    expected = None if family == "duo" else 49
    assert load(raw).mask_token_id == expected
    assert load(dict(raw, mask_token_id=None)).mask_token_id == expected
    with pytest.raises(ConfigError, match=r"config\.json: mask_token_id=.* is not the mask id this"):
        load(dict(raw, mask_token_id=value))
    if expected is not None:
        assert load(dict(raw, mask_token_id=49)).mask_token_id == 49


def test_a_run_is_refused_for_another_model_of_the_same_shape():
    """S4: the ownership check compared the config only, so another seed's model was accepted."""
    from mdm_lens import probes
    from mdm_lens.errors import InputError

    cfg = MDMConfig(d_model=32, n_layers=2, n_heads=4, d_head=8, d_mlp=64, d_vocab=64, n_ctx=256,
                    attention="bidirectional", logit_shift=True, mask_token_id=63, eos_token_id=62, family="dream")
    a, other, same = (HookedMDM.from_config(cfg, seed=s, init="realistic") for s in (0, 1, 0))
    out = a.generate(torch.tensor([[5, 6, 7]]), gen_length=8, kv_cache="dual", block_length=4, steps=4)
    want = probes.cache_effect(a, out).table
    assert probes.cache_effect(same, out).table.equals(want)  # a fresh load of the same weights
    for call in (lambda: probes.cache_effect(other, out), lambda: out.replay(other, 0), lambda: out.at_step(other, 0)):
        with pytest.raises(InputError, match="another model of the same shape"):
            with_ctx = call()
            if hasattr(with_ctx, "__enter__"):
                with with_ctx:
                    pass
    with torch.no_grad():
        a.blocks[0].attn.W_Q.add_(0.5)  # the same object, edited on purpose: its replay is allowed
    assert not probes.cache_effect(a, out).table.equals(want)


def test_sweep_refuses_max_passages_under_the_zoo_template(tmp_path):
    """S2: --max-passages was accepted under the zoo template (which shows every passage) and changed nothing."""
    from mdm_lens import sweep
    from mdm_lens.errors import InputError
    from mdm_lens.sweep.templates import passages_shown
    from mdm_lens.zoo import jsonl

    data = tmp_path / "items.jsonl"
    jsonl.export(data, 1, seed=0)
    with pytest.raises(InputError, match="max_passages=1: the 'zoo' template shows every passage") as err:
        sweep.run("mdm-lens/tiny-mdm", data, ["qk"], tmp_path / "out", max_passages=1, progress=False)
    assert err.value.argument == "max_passages" and not (tmp_path / "out").exists()
    assert passages_shown("zoo", None) == 5 and passages_shown("rag", None) == 5 and passages_shown("rag", 2) == 2
