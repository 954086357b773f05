"""Round 3c of misuse checks (held-out audit, findings 2, 3, 6, 7, 10, 15 and the unclear SAE-export /
features_from_cache ones): each test pins a class of input that used to pass silently or fail misleadingly."""

import warnings

import pytest
import torch

from mdm_lens import HookedMDM, MDMConfig
from mdm_lens.errors import SamplerConfigError

CFG = dict(d_model=32, n_layers=2, n_heads=4, d_mlp=48, d_vocab=50, mask_token_id=49)
PROMPT = torch.tensor([[3, 7, 11, 2]])


@pytest.fixture(scope="module")
def mdm():
    return HookedMDM.from_config(MDMConfig(**CFG), seed=1, init_std=0.2, init="realistic")


@pytest.fixture(scope="module")
def dream():
    return HookedMDM.from_config(MDMConfig(**CFG, family="dream", logit_shift=True), seed=2, init_std=0.2,
                                 init="realistic")


@pytest.fixture(scope="module")
def tiny():
    return HookedMDM.from_pretrained("mdm-lens/tiny-mdm")


# --- finding 2: steps= under a rule that decides the number of forwards ------------------------------------------
@pytest.mark.parametrize("kw, culprit", [(dict(threshold=0.9), "threshold=0.9"), (dict(factor=1.0), "factor=1.0"),
                                         (dict(sampler_rule="eb"), "sampler_rule='eb'"),
                                         (dict(kv_cache="prefix", threshold=0.9), "threshold=0.9")])
@pytest.mark.parametrize("steps", [2, 1000])
def test_llada_steps_is_refused_where_threshold_factor_or_eb_decide_the_length(mdm, kw, culprit, steps):
    with pytest.raises(SamplerConfigError, match="no effect") as e:
        mdm.generate(PROMPT, gen_length=8, steps=steps, **kw)
    assert e.value.argument == "steps" and e.value.value == steps and culprit in str(e.value)


def test_steps_still_acts_without_those_rules_and_equal_to_gen_length_is_accepted(tiny):
    p = torch.tensor([[1, 5, 6, 7]])
    assert tiny.generate(p, gen_length=8, steps=4).trajectory.n_steps == 4
    # kv_cache alone follows the block schedule, where steps counts
    out = tiny.generate(p, gen_length=8, steps=4, block_length=4, kv_cache="prefix")
    assert out.settings["steps"] == 4
    # steps == gen_length is what an unset steps resolves to (the probes always pass both): accepted, same run
    a = tiny.generate(p, gen_length=8, threshold=0.9)
    b = tiny.generate(p, gen_length=8, steps=8, threshold=0.9)
    assert torch.equal(a.tokens, b.tokens) and a.settings["steps"] == b.settings["steps"] == 8


def test_dream_steps_is_refused_under_threshold_and_factor(dream):
    for kw, culprit in ((dict(threshold=0.5), "threshold=0.5"), (dict(factor=1.0), "factor=1.0")):
        with pytest.raises(SamplerConfigError, match="no effect") as e:
            dream.generate(PROMPT, gen_length=8, steps=4, kv_cache="dual", block_length=4, **kw)
        assert e.value.argument == "steps" and culprit in str(e.value)
    assert dream.generate(PROMPT, gen_length=8, steps=4, kv_cache="dual", block_length=4).settings["steps"] == 4
