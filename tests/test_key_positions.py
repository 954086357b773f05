"""Every forward's key columns at their canvas positions: BD3LM forwards whose keys are a window past position 0
(the canvas longer than context_size / model_length, the KV cache sliding) or not one run of positions at all
(a KV cache that skipped an unfinished block). The reducers must agree, column by column, with the forward's own
cached pattern and keys mapped through `state.key_positions`."""

from __future__ import annotations

import pytest
import torch

from mdm_lens import HookedMDM, KeyValueNorms, ReceivedAttention, TopKKeys
from mdm_lens.errors import InputError
from tests.families.bd3gidd_checkpoints import write_bd3lm

PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10]])
NAMES = ["blocks.1.attn.hook_pattern", "blocks.1.attn.hook_rot_k"]


@pytest.fixture(scope="module")
def bd3(tmp_path_factory):
    folder, _ = write_bd3lm(tmp_path_factory.mktemp("bd3keys"), seed=3)  # block 4, model_length 16
    return HookedMDM.from_pretrained(str(folder), load_tokenizer=False)


def _run(bd3, **kw):
    rec = [TopKKeys(k=2), KeyValueNorms(), ReceivedAttention(), ReceivedAttention(query="masked", name="masked_ra")]
    with pytest.warns(UserWarning) if kw.get("steps", 4) < 4 else _nothing():
        return bd3.generate(PROMPT, seed=0, record=rec, cache=NAMES, **kw)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


RUNS = {"slid window": dict(gen_length=27, steps=4),
        "short context": dict(gen_length=11, steps=4, context_size=8),
        "kv cache sliding": dict(gen_length=26, steps=4, kv_cache=True),
        "kv cache, unstored blocks": dict(gen_length=14, steps=2, kv_cache=True)}


@pytest.mark.parametrize("kw", RUNS.values(), ids=RUNS.keys())
def test_reducers_place_keys_at_the_forwards_positions(bd3, kw):
    out = _run(bd3, **kw)
    moved = 0
    for s in out.cache.steps:
        state = out.state_at(s)
        keys, rows = out.cache.key_positions_of(s), out.cache.rows_of(s)
        assert torch.equal(state.key_positions[0], keys)
        moved += int(keys[0] > 0 or not state.keys_contiguous)
        pat = out.cache[s][NAMES[0]][0].double()  # [head, query, key]
        top = out.records["topk_keys"][s, 0, 1, :, rows]
        assert torch.equal(top, keys[pat.topk(2, dim=-1).indices])
        norms = out.records["key_norms"][s, 0, 1]
        assert torch.allclose(norms[:, keys], out.cache[s][NAMES[1]][0].norm(dim=-1).T, atol=1e-5)
        others = torch.ones(norms.shape[-1], dtype=torch.bool)
        others[keys] = False
        assert bool(norms[:, others].isnan().all())  # not a key of this forward: NaN, not a norm
        # not a key of this forward: NaN (it did not exist there), not a key that received 0
        expected = torch.full_like(out.records["received_attention"][s, 0, 1], float("nan"), dtype=torch.float64)
        expected[:, keys] = pat.mean(1)
        assert torch.allclose(out.records["received_attention"][s, 0, 1].double(), expected, atol=1e-6,
                              equal_nan=True)
        masked = state.masked[0, rows]
        got = out.records["masked_ra"][s, 0, 1]
        if masked.any():
            expected = torch.full_like(got, float("nan"), dtype=torch.float64)
            expected[:, keys] = pat[:, masked].mean(1)
            assert torch.allclose(got.double(), expected, atol=1e-6, equal_nan=True)
        else:
            assert bool(got[:, keys].isnan().all())  # no masked query at this step: undefined
    assert moved > 0  # the run really has forwards whose keys are not the canvas prefix


def test_a_kv_cache_that_skipped_a_block_names_each_key(bd3):
    out = _run(bd3, **RUNS["kv cache, unstored blocks"])
    # prompt block 0 stored; block 1 finishes and is stored; block 2 keeps masks (2 steps, 4 positions): not stored,
    # so block 3's keys are blocks 0, 1 and its own
    assert out.cache.key_positions_of(6).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 12, 13, 14, 15]
    assert not out.state_at(6).keys_contiguous and out.state_at(6).keys == slice(0, 16)
    with pytest.raises(InputError, match="key_positions_of"):
        out.cache.keys_of(6)
    with pytest.raises(InputError, match="not one run of positions"):
        out.cache.stack(NAMES[0], align=True)
    assert out.cache.keys_of(4) == slice(0, 12)  # block 2: stored blocks 0, 1 and its own, one run
