"""absorption_by_layer without whole patterns: the received mass summed over query chunks inside the attention
equals the pattern path (float64 rounding) in every mode; long inputs switch to it on their own; the sweep does
the same when one layer's patterns exceed the budget (and refuses flow there)."""

from __future__ import annotations

import pytest
import torch

from mdm_lens import HookedMDM, sweep
from mdm_lens.errors import MemoryBudgetError
from mdm_lens.pattern_rows import set_query_chunk
from mdm_lens.probes import absorption as A
from mdm_lens.probes import run as R
from mdm_lens.zoo import jsonl


@pytest.fixture(scope="module", params=["mdm-lens/tiny-mdm", "mdm-lens/tiny-arm"])
def model(request):
    return HookedMDM.from_pretrained(request.param)


def _batch(T=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(5, 300, (3, T), generator=g)
    am = torch.ones(3, T, dtype=torch.long)
    am[1, :7] = 0                                                     # left padding in one row
    return toks, am


@pytest.mark.parametrize("mode,head", [("default", "mean"), ("default", "each"), ("paper", "mean")])
def test_chunked_equals_the_pattern_path(model, mode, head):
    toks, am = _batch()
    full = R.absorption_by_layer(model, toks, attention_mask=am, mode=mode, head=head, chunked=False)
    set_query_chunk(model, 7)                                         # several chunks per forward
    try:
        part = R.absorption_by_layer(model, toks, attention_mask=am, mode=mode, head=head, chunked=True)
    finally:
        set_query_chunk(model, None)
    assert part.variants == full.variants
    for name in ("per_sample", "null", "excess", "n_anchors"):
        assert torch.allclose(getattr(part, name), getattr(full, name), atol=1e-9, rtol=0), name


def test_long_inputs_go_chunked_on_their_own(model, monkeypatch):
    toks, am = _batch()
    expected = R.absorption_by_layer(model, toks, attention_mask=am, chunked=False)
    monkeypatch.setattr(A, "PATTERN_BUDGET_BYTES", 3 * model.cfg.n_heads * 40 * 40 * 8 - 1)   # one layer too many
    monkeypatch.setattr(A, "final_attention", lambda *a, **k: pytest.fail("held the whole patterns"))
    got = R.absorption_by_layer(model, toks, attention_mask=am)
    assert torch.allclose(got.per_sample, expected.per_sample, atol=1e-9, rtol=0)


def test_sweep_absorption_at_a_context_whose_patterns_do_not_fit(model, tmp_path, monkeypatch):
    data = tmp_path / "items.jsonl"
    jsonl.export(data, 2, seed=34)
    normal = sweep.run(model, data, "absorption", tmp_path / "a", progress=False)["absorption"]
    monkeypatch.setattr(A, "PATTERN_BUDGET_BYTES", 1)
    for module in (A, R):
        monkeypatch.setattr(module, "final_attention", lambda *a, **k: pytest.fail("held the whole patterns"))
    long = sweep.run(model, data, "absorption", tmp_path / "b", progress=False)["absorption"]
    assert list(long.columns) == list(normal.columns) and len(long) == len(normal)
    keys = [c for c in normal.columns if c != "value"]
    m = normal.merge(long, on=keys, suffixes=("", "_chunked"))
    assert len(m) == len(normal)
    assert (m.value - m.value_chunked).abs().max() < 1e-9
    with pytest.raises(MemoryBudgetError, match="flow needs"):
        sweep.run(model, data, "flow", tmp_path / "c", progress=False)
