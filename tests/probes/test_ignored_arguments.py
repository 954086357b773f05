"""Arguments that one mode would silently ignore are refused with an `ArgumentError` naming both arguments (issue 32
D), table-driven; the same calls with the neutral value run. Before: `absorption_by_layer(mode="paper", head="each")`
returned the head-mean table."""

from __future__ import annotations

import pytest
import torch

from mdm_lens import HookedMDM, MDMConfig
from mdm_lens.errors import ArgumentError
from mdm_lens.probes import absorption as A
from mdm_lens.probes import flow as F
from mdm_lens.probes.qk import paper_qk_maps


@pytest.fixture(scope="module")
def model():
    cfg = MDMConfig(d_model=32, n_layers=2, n_heads=2, n_kv_heads=2, d_mlp=48, d_vocab=50, mask_token_id=49,
                    n_ctx=32)
    return HookedMDM.from_config(cfg, seed=1, init_std=0.2, init="realistic")


TOKENS = torch.tensor([[3, 4, 5, 6, 7, 8]])


def _attn():
    a = torch.rand(2, 2, 6, 6, generator=torch.Generator().manual_seed(0))
    return a / a.sum(-1, keepdim=True)  # [layer, head, q, k]


def _regions():
    return [F.Region("q", 0, 2, "query"), F.Region("g", 2, 4, "gold"), F.Region("a", 4, 6, "answer")]


# (name, call(model, value), refused argument, its neutral value, the value refused, the mode argument named)
CASES = [
    ("absorption.head", lambda m, v: A.absorption_by_layer(m, TOKENS, mode="paper", head=v), "head", "mean", "each"),
    ("absorption.rule", lambda m, v: A.absorption_by_layer(m, TOKENS, mode="paper", rule=v), "rule", "zscore",
     "gu"),
    ("absorption_chunked.head", lambda m, v: A.absorption_chunked(m, TOKENS, None, "paper", "zscore", v, [0, 1]),
     "head", "mean", "each"),
    ("flow.residual", lambda m, v: F.flow(_attn().mean(1), _regions(), mode="paper", residual=v, warn=False),
     "residual", 0.5, 0.3),
    ("paper_qk_maps.head", lambda m, v: paper_qk_maps(torch.rand(1, 4, 2, 8), torch.rand(1, 4, 2, 8), head_avg=True,
                                                      head=v), "head", None, 1),
]


@pytest.mark.parametrize("name,call,argument,neutral,refused", CASES, ids=[c[0] for c in CASES])
def test_an_ignored_argument_is_refused_naming_both(model, name, call, argument, neutral, refused):
    with pytest.raises(ArgumentError) as err:
        call(model, refused)
    msg = str(err.value)
    assert err.value.argument == argument and f"{argument}=" in msg
    assert ("mode=" in msg or "head_avg=" in msg), msg
    call(model, neutral)  # the neutral value runs


def test_default_mode_still_computes_per_head(model):
    each = A.absorption_by_layer(model, TOKENS, head="each").table()
    mean = A.absorption_by_layer(model, TOKENS, head="mean").table()
    assert each.shape == mean.shape and not each.equals(mean)
