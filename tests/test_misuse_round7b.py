"""Held-out misuse, round seven (b), on the DDiT research models (MDLM, Duo, BD3LM, GIDD): a bf16 / fp16 checkpoint
runs in its dtype, TransformerLens weight processing and weight-analysis attributes are refused with the adaLN reason,
`HookedDDiT.from_pretrained` loads BD3LM / GIDD folders, save_pretrained refuses DDiT models, sampler refusals name
the right reason (BD3LM's block is config.json's block_size, cache_effect covers Fast-dLLM's caches), the report
never prints a raw nan, and a reducer scheduled only on steps that reused MDLM's cache keeps an empty record whose
readers say why it is empty."""

from __future__ import annotations

import pytest
import torch

from mdm_lens import HookedMDM
from tests.families.bd3gidd_checkpoints import write_bd3lm, write_gidd
from tests.families.ddit_checkpoints import DUO_CONFIG, MDLM_CONFIG, write_ddit

FAMILIES = ("mdlm", "duo", "bd3lm", "gidd")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("misuse7b")
    return dict(mdlm=write_ddit(tmp / "m", MDLM_CONFIG, seed=3)[0], duo=write_ddit(tmp / "d", DUO_CONFIG, seed=3)[0],
                bd3lm=write_bd3lm(tmp / "b", seed=3)[0], gidd=write_gidd(tmp / "g", seed=3)[0])


def _load(folder, **kw):
    return HookedMDM.from_pretrained(str(folder), load_tokenizer=False, **kw)


# --- 1. a bf16 / fp16 checkpoint runs in its dtype -----------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_ddit_model_runs_in_its_dtype_close_to_fp32(folders, family, dtype):
    fp32, half = _load(folders[family]), _load(folders[family], dtype=str(dtype).removeprefix("torch."))
    x = torch.randint(0, fp32.cfg.d_vocab - 1, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = fp32(x, sigma=0.3)
        b, cache = half.run_with_cache(x, sigma=0.3)
    assert b.dtype == dtype and cache["blocks.0.hook_modulated"].dtype == dtype
    assert cache["blocks.0.ln1.hook_normalized"].dtype == torch.float32  # the norm computes in fp32
    assert cache["blocks.0.attn.hook_pattern"].dtype == dtype
    rel = float((a - b.float()).abs().mean() / a.abs().mean())
    assert 1e-5 < rel < 0.08  # half precision really ran, and stayed close
    assert float((a.argmax(-1) == b.float().argmax(-1)).float().mean()) > 0.9
    assert bool(torch.isfinite(half(x, sigma=0.3, return_type="log_probs").float().exp().sum(-1)).all())
    gen = 15 if family == "bd3lm" else 8
    out = half.generate(torch.full((1, 1), 7), gen_length=gen, steps=4)
    assert out.tokens.shape == (1, 1 + gen)
    if family == "bd3lm":
        assert half.generate(torch.full((1, 1), 7), gen_length=15, steps=4, kv_cache=True).tokens.shape == (1, 16)
