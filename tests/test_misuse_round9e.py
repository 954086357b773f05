"""Held-out misuse17 findings (each test fails on the behaviour the audit met): an explicit attn_mask on a
block-causal model is the whole mask asked for, noise_level warns on a model that ignores σ, and the sweep report
names an unreadable table."""

from __future__ import annotations

import pytest
import torch

from mdm_lens import HookedMDM, masks
from mdm_lens.errors import InputError


def test_an_explicit_attn_mask_replaces_a_block_models_default_block_mask(tmp_path):
    from tests.families.family_checkpoints import write_sdar

    m = HookedMDM.from_pretrained(str(write_sdar(tmp_path / "s")[0]), load_tokenizer=False)
    B = m.cfg.extra["block_length"]
    toks = torch.tensor([[5, 17, 33, 7, 61, 40, 9, 12, 44, 3, 8, 2, 19, 23, 31, 6]])
    n = toks.shape[1]
    with torch.no_grad():
        default = m(toks)
        wide = m(toks, block_length=2 * B)
        full = m(toks, block_length=n)
        torch.testing.assert_close(m(toks, attn_mask=masks.block_causal(n, 2 * B)), wide, rtol=0, atol=1e-5)
        torch.testing.assert_close(m(toks, attn_mask=torch.ones(n, n, dtype=torch.bool)), full, rtol=0, atol=1e-5)
        # both given: ANDed (the default block mask is the narrower)
        torch.testing.assert_close(m(toks, attn_mask=masks.block_causal(n, 2 * B), block_length=B), default,
                                   rtol=0, atol=1e-5)
    assert float((wide - default).abs().max()) > 1e-3  # the masks differ on this model


def test_noise_level_warns_when_the_model_ignores_sigma():
    from mdm_lens.ddit import HookedDDiT, ddit_config
    from mdm_lens.probes.noise_level import noise_level

    cfg = ddit_config("mdlm", d_vocab=40, n_ctx=16, d_model=32, cond_dim=16, n_layers=2, n_heads=2,
                      time_conditioning=False)
    m = HookedDDiT.from_config(cfg, seed=0)
    toks = torch.randint(0, 39, (1, 8), generator=torch.Generator().manual_seed(0))
    toks[0, 4:] = cfg.mask_token_id
    with pytest.warns(UserWarning, match="time_conditioning is off"):
        r = noise_level(m, toks, levels=[0.1, 2.0])
    assert "time_conditioning is off" in r.meaning


@pytest.mark.parametrize("damage", ["garbage", "no value column"])
def test_the_sweep_report_names_an_unreadable_table(tmp_path, damage):
    import pandas as pd

    from mdm_lens.views.sweep_report import _read

    path = tmp_path / "absorption.parquet"
    if damage == "garbage":
        path.write_bytes(b"garbage")
    else:
        pd.DataFrame({"item_id": ["a"], "layer": [0], "variant": ["pos0"]}).to_parquet(path)
    with pytest.raises(InputError, match="absorption.parquet") as err:
        _read("absorption", path)
    assert err.value.argument == "folder"


def test_an_unnamed_at_steps_hook_says_to_name_it():
    from mdm_lens.errors import ArgumentTypeError
    from mdm_lens.hooks import at_steps

    m = HookedMDM.from_pretrained("mdm-lens/tiny-mdm")
    with pytest.raises(ArgumentTypeError, match="has no hook name: build it with name="):
        m.generate(torch.tensor([[10, 11, 12, 13]]), steps=4, gen_length=8, fwd_hooks=[at_steps(lambda z, hook: z, [1])])
    m.generate(torch.tensor([[10, 11, 12, 13]]), steps=4, gen_length=8,
               fwd_hooks=[at_steps(lambda z, hook: z, [1], name="blocks.0.attn.hook_z")])


@pytest.mark.parametrize("reset", [True, False])
def test_a_reset_backward_hook_does_not_run_on_a_later_backward(reset):
    # misuse17 S3: PyTorch keeps a module's full backward hooks in the graph, so the reset hook still edited grads
    m = HookedMDM.from_pretrained("mdm-lens/tiny-mdm")
    clean = torch.randint(5, 300, (1, 10), generator=torch.Generator().manual_seed(0))
    x = clean.clone()
    x[0, 5:] = m.cfg.mask_token_id
    fired = []

    def zero(grad, hook):
        fired.append(hook.name)
        return grad * 0

    loss = m.run_with_hooks(x, return_type="loss", targets=clean, bwd_hooks=[("blocks.0.hook_resid_pre", zero)],
                            reset_hooks_end=reset)
    loss.backward()
    m.reset_hooks()
    assert fired == ([] if reset else ["blocks.0.hook_resid_pre"])
    assert (float(m.embed.W_E.grad.norm()) > 0) == reset  # the zeroing edit applies only while the hook lives
