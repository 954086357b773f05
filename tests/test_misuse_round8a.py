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
