"""Held-out misuse findings, round ten (misuse17's U2 and the run on the final main): each test fails on the code
before its fix."""

from __future__ import annotations

import pytest

from mdm_lens.errors import SamplerConfigError
from test_fastdllm_v2 import planted_model


def test_fastdllm_v2_blames_a_block_size_that_does_not_divide_32_before_the_small_block_default():
    # block_size=3 is wrong whatever small_block_size is (the reference masks over 32-token blocks); blaming the
    # untouched small_block_size=8 default first sent the user to "fix" it and then meet this error anyway.
    model = planted_model()
    with pytest.raises(SamplerConfigError) as e:
        model.generate([[20, 21]], sampler="fastdllm_v2", block_size=3, max_new_tokens=16, stop_token=1)
    assert e.value.argument == "block_size" and e.value.value == 3 and "divide 32" in str(e.value)
