"""Held-out misuse15 findings (each test fails on the behaviour the audit met): a fully blind attn_mask, a callable
metric that returns no scalar, and the refusals that pointed to a dead end (native layer key, DDiT incl_bwd, a
trajectory cache indexed the TransformerLens way, the export's force flag, a derived sampler default)."""

from __future__ import annotations

import json

import pytest
import torch

from mdm_lens import HookedMDM, MDMConfig
from mdm_lens.errors import ArgumentError, ArgumentTypeError, CheckpointError, InputError, SamplerConfigError

CFG = dict(d_model=32, n_layers=2, n_heads=4, d_mlp=64, d_vocab=50, n_ctx=64, mask_token_id=49, bos_token_id=1,
           eos_token_id=2, pad_token_id=0, model_name="t")


@pytest.fixture(scope="module")
def small():
    return HookedMDM.from_config(MDMConfig(**CFG), seed=0)


@pytest.fixture(scope="module")
def tiny():
    return HookedMDM.from_pretrained("mdm-lens/tiny-mdm")


def test_an_attn_mask_blind_for_a_whole_batch_row_is_refused(small):
    t = torch.tensor([[1, 5, 6, 7, 49, 49, 49, 2]])
    with pytest.raises(InputError, match="every query of batch row 0"):
        small(t, attn_mask=torch.zeros(8, 8, dtype=torch.bool))
    mk = torch.ones(2, 1, 8, 8, dtype=torch.bool)
    mk[1] = False
    with pytest.raises(InputError, match="batch row 1") as err:
        small(t.expand(2, -1), attn_mask=mk)
    assert err.value.argument == "attn_mask"
    pair = torch.ones(8, 8, dtype=torch.bool)  # Dream's pair mask: a pad hidden as query and key stays allowed
    pair[7, :] = False
    pair[:, 7] = False
    assert small(t, attn_mask=pair).isfinite().all()


@pytest.mark.parametrize("bad", [lambda lg: lg[..., :3], lambda lg: "x", lambda lg: torch.tensor([1.0, 2.0])])
def test_a_callable_metric_that_returns_no_scalar_is_a_typed_error(tiny, bad):
    from mdm_lens.probes import patching as PT

    p, pc = torch.tensor([[1, 10, 11, 12, 13]]), torch.tensor([[1, 20, 21, 22, 23]])
    with pytest.raises(ArgumentTypeError, match="callable metric maps the readout logits") as err:
        PT.patch_anchor_activations(tiny, p, pc, gen_length=4, n_steps=4, metric=bad)
    assert err.value.argument == "metric"
    ok = PT.patch_anchor_activations(tiny, p, pc, gen_length=4, n_steps=4, metric=lambda lg: lg[..., 5].mean())
    assert ok is not None


def test_a_native_checkpoint_with_the_wrong_layer_count_names_its_own_key(tmp_path, small):
    from mdm_lens.loading import save_pretrained

    f = tmp_path / "ck"
    save_pretrained(small, f)
    c = json.loads((f / "config.json").read_text())
    (f / "config.json").write_text(json.dumps(dict(c, n_layers=3)))
    with pytest.raises(CheckpointError) as err:
        HookedMDM.from_pretrained(str(f))
    text = str(err.value)
    assert "n_layers gives 3 layers" in text and "num_hidden_layers" not in text and "absent" not in text


def test_ddit_incl_bwd_points_to_what_works():
    from mdm_lens.ddit import HookedDDiT, ddit_config

    cfg = ddit_config("mdlm", d_vocab=40, n_ctx=16, d_model=32, cond_dim=16, n_layers=2, n_heads=2,
                      time_conditioning=False)
    m = HookedDDiT.from_config(cfg, seed=0)
    with pytest.raises(InputError, match="has no 'loss'.*reset_hooks_end=False"):
        m.run_with_cache(torch.randint(0, 39, (1, 8)), incl_bwd=True)


def test_a_trajectory_cache_indexed_by_name_first_says_step_first(tiny):
    out = tiny.generate(torch.tensor([[1, 10, 11, 12, 13]]), steps=4, gen_length=4, cache="blocks.0.hook_resid_post")
    with pytest.raises(ArgumentTypeError, match=r"write cache\[step\]\['blocks.0.hook_resid_post'\]"):
        out.cache["blocks.0.hook_resid_post", 0]
    assert out.cache[0, "cond"]["blocks.0.hook_resid_post"].shape[-1] == tiny.cfg.d_model


def test_an_export_into_a_folder_of_other_arguments_names_the_python_keyword(tiny, tmp_path):
    from mdm_lens import steps
    from mdm_lens.sae import export_activations

    kw = dict(out=str(tmp_path / "acts"), steps=steps(0), n_steps=4, gen_length=4, progress=False)
    export_activations(tiny, [[1, 10, 11, 12, 13]], "blocks.1.hook_resid_post", **kw)
    with pytest.raises(ArgumentError, match=r"pass force=True \(CLI: --force\)"):
        export_activations(tiny, [[1, 10, 11, 12, 13]], "blocks.2.hook_resid_post", **kw)


def test_a_derived_default_that_conflicts_says_which_value_it_took(small):
    m = HookedMDM.from_config(MDMConfig(**dict(CFG, logit_shift=True)), seed=0)
    with pytest.raises(SamplerConfigError) as err:
        m.generate(torch.tensor([[1, 5, 6, 7]]), sampler="dream", steps=4, gen_length=4, kv_cache="prefix")
    assert "it took 32" in str(err.value) and "comes from the checkpoint" not in str(err.value)
