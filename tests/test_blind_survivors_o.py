"""Survivors of blind mutation list O (written on 0d26d61 by a helper who never read tests/): each test fails on
its mutant, checked by applying it."""

from __future__ import annotations

import math

import pytest
import torch

from mdm_lens import validate
from mdm_lens.errors import ArgumentError, ConfigError, InputError


def test_seed_range_ends_at_torchs_last_seed():
    # torch's generators take [-2**63, 2**64 - 1]: the last one is accepted, one past it is a typed error (torch's own
    # is a raw RuntimeError from manual_seed)
    assert validate.seed(2**64 - 1) == 2**64 - 1
    torch.Generator().manual_seed(validate.seed(2**64 - 1))
    for bad in (2**64, -1):
        with pytest.raises(ArgumentError) as e:
            validate.seed(bad)
        assert e.value.argument == "seed" and e.value.value == bad
    assert validate.seed(-(2**63), min=None) == -(2**63)
    with pytest.raises(ArgumentError):
        validate.seed(-(2**63) - 1, min=None)


@pytest.mark.parametrize("key,value", [("attn_only", 0), ("attn_only", 0.0), ("attn_only", None)])
def test_tl_constants_are_refused_by_type_as_well_as_value(key, value):
    # attn_only=0 equals False but is not a bool: TL's helpers branch on `cfg.attn_only is ...`-style reads and a
    # saved config would carry the int; the check compares type and value
    from mdm_lens import HookedMDM, MDMConfig
    from mdm_lens.config import check_tl_constants

    with pytest.raises(ConfigError, match=key):
        check_tl_constants({key: value})
    check_tl_constants({key: False, "act_fn": "silu"})
    with pytest.raises(ConfigError, match=key):
        HookedMDM.from_config(MDMConfig(d_model=16, n_layers=1, n_heads=2, d_mlp=16, d_vocab=20, mask_token_id=19,
                                        **{key: value}), seed=0)


def test_retrieval_top_k_stops_at_the_scored_heads():
    # two of four heads scored: k=2 ranks them, k=3 would rank a NaN head as third and is refused
    from mdm_lens.probes._retrieval_items import RetrievalScores

    scores = torch.tensor([[0.2, math.nan], [math.nan, 0.7]])
    result = RetrievalScores(method="copy", threshold=0.1, layers=[3, 5], scores=scores,
                             per_sample=scores[None], correct=torch.tensor([True]), n_counted=1,
                             above_threshold=[(5, 1), (3, 0)], retrieval_heads=[(5, 1), (3, 0)])
    assert result.top(2) == [(5, 1), (3, 0)] and result.top(1) == [(5, 1)]
    with pytest.raises(ArgumentError) as e:
        result.top(3)
    assert e.value.argument == "k" and e.value.value == 3
    with pytest.raises(InputError):
        RetrievalScores(method="copy", threshold=0.1, layers=[0], scores=torch.full((1, 2), math.nan),
                        per_sample=torch.full((1, 1, 2), math.nan), correct=torch.tensor([False]), n_counted=0,
                        above_threshold=[], retrieval_heads=[]).top(1)
