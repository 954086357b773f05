"""MDLM / Duo (the DDiT core, mdm_lens.ddit): hub-layout loading, exact logits against a plain-torch transcription of
the reference forward, the output parameterisations, config facts, and the conditioning hooks."""

from __future__ import annotations

import pytest
import torch

from mdm_lens import HookedMDM
from mdm_lens.ddit import HookedDDiT
from mdm_lens.errors import ArgumentTypeError, CheckpointError, ConfigError, InputError
from tests.families.ddit_checkpoints import DUO_CONFIG, MDLM_CONFIG, write_ddit
from tests.families.ddit_reference import reference_forward, reference_subs


@pytest.fixture(scope="module")
def mdlm(tmp_path_factory):
    folder, sd = write_ddit(tmp_path_factory.mktemp("mdlm"), MDLM_CONFIG, seed=1)
    return HookedMDM.from_pretrained(str(folder), load_tokenizer=False), sd


@pytest.fixture(scope="module")
def duo(tmp_path_factory):
    folder, sd = write_ddit(tmp_path_factory.mktemp("duo"), DUO_CONFIG, seed=2, fmt="bin")
    return HookedMDM.from_pretrained(str(folder), load_tokenizer=False), sd


def _tokens(cfg: dict, batch: int = 3, seed: int = 0, mask_frac: float = 0.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg["vocab_size"] - 1, (batch, cfg["model_length"]), generator=g)
    if mask_frac:
        x[torch.rand(x.shape, generator=g) < mask_frac] = cfg["vocab_size"] - 1
    return x


def test_mdlm_layout_loads_into_hooked_ddit_with_its_config_values(mdlm):
    model, _ = mdlm
    assert isinstance(model, HookedDDiT)
    c = model.cfg
    assert (c.family, c.d_vocab, c.n_ctx, c.d_model, c.n_layers, c.n_heads, c.d_head, c.d_mlp) == \
        ("mdlm", 61, 24, 48, 2, 4, 12, 192)
    assert c.extra["cond_dim"] == 20 and c.extra["time_conditioning"] is False and c.mask_token_id == 60


def test_mdlm_logits_match_the_reference_transcription(mdlm):
    model, sd = mdlm
    x = _tokens(MDLM_CONFIG, mask_frac=0.4)
    sigma = torch.tensor([0.0, 0.7, 3.0])
    ref = reference_forward(sd, 4, x, sigma, time_conditioning=False)
    got = model(x, sigma=sigma)
    assert ref.abs().max() > 1.0  # a non-degenerate output
    torch.testing.assert_close(got, ref, atol=1e-4 * float(ref.abs().max()), rtol=0)
    torch.testing.assert_close(model(x, sigma=sigma, return_type="log_probs"), reference_subs(ref, x, 60),
                               atol=1e-4 * float(ref.abs().max()), rtol=0)


def test_mdlm_without_time_conditioning_ignores_sigma_but_runs_the_adaln_path(mdlm):
    model, sd = mdlm
    x = _tokens(MDLM_CONFIG, batch=2)
    a, b = model(x, sigma=0.0), model(x, sigma=torch.tensor([5.0, 9.0]))
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    # σ = 0 still feeds c = silu(mlp(cos 0 = 1, sin 0 = 0)): dropping the conditioning changes the logits
    _, cache = model.run_with_cache(x, sigma=0.0, names_filter="hook_cond")
    assert cache["hook_cond"].abs().min() > 0
    zeroed = model.run_with_hooks(x, sigma=0.0, fwd_hooks=[("hook_cond", lambda t, hook: torch.zeros_like(t))])
    assert (zeroed - a).abs().max() > 0.1


def test_duo_bin_layout_matches_the_reference_and_is_time_conditioned(duo):
    model, sd = duo
    assert model.cfg.family == "duo" and model.cfg.mask_token_id is None and model.cfg.extra["time_conditioning"]
    x = _tokens(DUO_CONFIG)
    sigma = torch.tensor([0.01, 1.5, 6.9])
    ref = reference_forward(sd, 2, x, sigma, time_conditioning=True)
    got = model(x, sigma=sigma)
    torch.testing.assert_close(got, ref, atol=1e-4 * float(ref.abs().max()), rtol=0)
    torch.testing.assert_close(model(x, sigma=sigma, return_type="log_probs"), torch.log_softmax(ref, -1),
                               atol=1e-4 * float(ref.abs().max()), rtol=0)
    assert (model(x, sigma=0.2) - model(x, sigma=2.0)).abs().max() > 0.05  # σ matters
    # σ omitted outside a denoising step: the clean-data σ at t = 1e-5 (documented, not a silent zero)
    clean = -torch.log1p(torch.tensor(-(1 - 1e-3) * 1e-5))
    torch.testing.assert_close(model(x), model(x, sigma=clean), rtol=0, atol=0)


def test_patching_hook_cond_from_one_sigma_into_another_equals_the_forward_at_the_first(duo):
    model, _ = duo
    x = _tokens(DUO_CONFIG, batch=2, seed=3)
    sj, sk = torch.tensor([0.3, 2.0]), torch.tensor([4.0, 0.05])
    _, cache = model.run_with_cache(x, sigma=sj, names_filter="hook_cond")
    patched = model.run_with_hooks(x, sigma=sk, fwd_hooks=[("hook_cond", lambda t, hook: cache["hook_cond"])])
    torch.testing.assert_close(patched, model(x, sigma=sj), rtol=0, atol=0)
    assert (patched - model(x, sigma=sk)).abs().max() > 0.05
    # the same holds one level down: every block's adaLN vectors carry the whole σ dependence
    names = [n for n in model.hook_dict if ".adaLN.hook_" in n or n.startswith("final_adaLN.")]
    _, cache = model.run_with_cache(x, sigma=sj, names_filter=names)
    hooks = [(n, (lambda t, hook: cache[hook.name])) for n in names]
    torch.testing.assert_close(model.run_with_hooks(x, sigma=sk, fwd_hooks=hooks), model(x, sigma=sj), rtol=0, atol=0)


def test_hooks_see_reference_intermediates(duo):
    model, sd = duo
    x = _tokens(DUO_CONFIG, batch=2, seed=4)
    _, cache = model.run_with_cache(x, sigma=torch.tensor([0.5, 1.0]))
    d = 32
    c = cache["hook_cond"]
    mods = torch.nn.functional.linear(c, sd["backbone.blocks.1.adaLN_modulation.weight"],
                                      sd["backbone.blocks.1.adaLN_modulation.bias"])
    torch.testing.assert_close(cache["blocks.1.adaLN.hook_gate_mlp"], mods[:, 5 * d:6 * d])
    torch.testing.assert_close(cache["blocks.1.adaLN.hook_shift_msa"], mods[:, :d])
    assert cache["blocks.0.attn.hook_pattern"].shape == (2, 2, 20, 20)
    torch.testing.assert_close(cache["blocks.0.attn.hook_pattern"].sum(-1), torch.ones(2, 2, 20))
    resid = cache["blocks.1.hook_resid_mid"] + cache["blocks.1.hook_mlp_out"]
    torch.testing.assert_close(cache["blocks.1.hook_resid_post"], resid)


def test_absent_config_keys_take_the_hub_class_defaults(tmp_path):
    # cond_dim absent → MDLMConfig's default 129 (the released config.json says 128): weights drawn with 129 load
    cfg = dict(MDLM_CONFIG, cond_dim=129)
    folder, sd = write_ddit(tmp_path / "m", cfg, drop=("cond_dim", "time_conditioning"))
    model = HookedMDM.from_pretrained(str(folder), load_tokenizer=False)
    assert model.cfg.extra["cond_dim"] == 129 and model.cfg.extra["time_conditioning"] is False
    folder, _ = write_ddit(tmp_path / "m2", MDLM_CONFIG, drop=("cond_dim",))  # 20-wide weights, default 129
    with pytest.raises(CheckpointError, match="cond_dim"):
        HookedMDM.from_pretrained(str(folder), load_tokenizer=False)


def test_time_conditioning_true_in_config_is_read(tmp_path):
    folder, sd = write_ddit(tmp_path / "tc", dict(MDLM_CONFIG, time_conditioning=True), seed=5)
    model = HookedMDM.from_pretrained(str(folder), load_tokenizer=False)
    x = _tokens(MDLM_CONFIG, batch=1)
    ref = reference_forward(sd, 4, x, torch.tensor([2.5]), time_conditioning=True)
    torch.testing.assert_close(model(x, sigma=2.5), ref, atol=1e-4 * float(ref.abs().max()), rtol=0)
    assert (model(x, sigma=2.5) - model(x, sigma=0.0)).abs().max() > 0.05


@pytest.mark.parametrize("change, error", [
    (dict(n_heads="4"), ConfigError), (dict(hidden_dim=0), ConfigError), (dict(model_type="duo", causal=True,
                                                                             architectures=["DUO"]), ConfigError),
    (dict(n_blocks=3), CheckpointError), (dict(vocab_size=62), CheckpointError), (dict(n_heads=2), CheckpointError),
])
def test_bad_configs_are_refused_naming_the_key(tmp_path, change, error):
    folder, _ = write_ddit(tmp_path / "bad", MDLM_CONFIG)
    import json

    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, **change}))
    with pytest.raises(error):
        HookedMDM.from_pretrained(str(folder), load_tokenizer=False)


def test_inputs_are_checked(mdlm):
    model, _ = mdlm
    x = _tokens(MDLM_CONFIG, batch=2)
    for bad in (torch.tensor([1.0, float("nan")]), -0.5, torch.tensor([1.0, 2.0, 3.0])):
        with pytest.raises(InputError, match="sigma"):
            model(x, sigma=bad)
    with pytest.raises(InputError, match="model_length"):
        model(torch.zeros(1, 25, dtype=torch.long), sigma=0.0)
    with pytest.raises(InputError, match=r"\[0, 61\)"):
        model(torch.full((1, 4), 61), sigma=0.0)


def test_random_realistic_model_has_non_trivial_norms_and_biases():
    from mdm_lens.ddit import ddit_config

    cfg = ddit_config("duo", d_vocab=30, n_ctx=12, d_model=16, cond_dim=8, n_layers=1, n_heads=2,
                      time_conditioning=True)
    model = HookedDDiT.from_config(cfg, seed=3)
    assert (model.blocks[0].ln1.w - 1).abs().mean() > 0.2
    assert model.blocks[0].adaLN.linear.bias.abs().mean() > 0.05
    assert model(torch.randint(0, 30, (1, 12)), sigma=1.0).shape == (1, 12, 30)


def test_bf16_autocast_path_follows_the_reference_choreography_and_stays_close(tmp_path):
    """The autocast-faithful path: bf16 branch outputs and logits, fp32 norms / residual / conditioning; close to
    fp32 by tolerance and argmax agreement (the random checkpoints' attention is sharp, so bf16 scores move
    patterns by up to ~0.3 on single entries: the mean error is the stable measure)."""
    for config in (MDLM_CONFIG, DUO_CONFIG):
        folder, _ = write_ddit(tmp_path / config["model_type"], config, seed=7)
        fp32 = HookedDDiT.from_pretrained(str(folder), load_tokenizer=False)
        bf16 = HookedDDiT.from_pretrained(str(folder), load_tokenizer=False, autocast=True)
        assert not fp32.autocast and bf16.autocast
        x = _tokens(config, batch=4, seed=1)
        with torch.no_grad():
            a, ca = fp32.run_with_cache(x, sigma=0.5)
            b, cb = bf16.run_with_cache(x, sigma=0.5)
        assert a.dtype == torch.float32 and b.dtype == torch.bfloat16
        assert cb["blocks.0.hook_attn_out"].dtype == cb["blocks.1.mlp.hook_post"].dtype == torch.bfloat16
        for fp32_name in ("hook_cond", "blocks.0.ln1.hook_normalized", "blocks.1.hook_resid_post",
                          "blocks.0.hook_modulated"):
            assert cb[fp32_name].dtype == torch.float32, fp32_name
        torch.testing.assert_close(cb["hook_cond"], ca["hook_cond"], rtol=0, atol=0)  # outside the autocast
        rel = float((a - b.float()).abs().mean() / a.abs().mean())
        assert 1e-4 < rel < 0.08  # bf16 really ran, and stayed close
        assert float((a.argmax(-1) == b.float().argmax(-1)).float().mean()) > 0.9
    with pytest.raises(ArgumentTypeError, match="autocast"):
        HookedDDiT.from_pretrained(str(folder), load_tokenizer=False, autocast="yes")


def test_a_float64_model_computes_norms_time_features_and_rotary_in_float64(tmp_path, monkeypatch):
    # the references' `.float()` would downcast a float64 run (mdm_lens.precision): against the transcription with
    # its norm and time features kept in float64, a float64 Duo agrees to float64 rounding, far below fp32's
    import math

    import torch.nn.functional as F

    from tests.families import ddit_reference as R

    folder, sd = write_ddit(tmp_path / "duo64", DUO_CONFIG, seed=5)
    model = HookedMDM.from_pretrained(str(folder), load_tokenizer=False, dtype=torch.float64)
    sd64 = {k: v.double() for k, v in sd.items()}
    d = model.cfg.d_head  # the hub's inv_freq buffer holds fp32-rounded frequencies: the float64 ones instead
    sd64["backbone.rotary_emb.inv_freq"] = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    monkeypatch.setattr(R, "_layer_norm", lambda x, w: F.layer_norm(x, [x.shape[-1]]) * w[None, None, :])

    def freqs64(t, dim=256, max_period=10000):
        half = dim // 2
        f = torch.exp(-math.log(max_period) * torch.arange(0, half, dtype=torch.float64) / half)
        args = t[:, None].double() * f[None]
        return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)

    monkeypatch.setattr(R, "_timestep_embedding", freqs64)
    x, sigma = _tokens(DUO_CONFIG), torch.tensor([0.01, 1.5, 6.9], dtype=torch.float64)
    ref = R.reference_forward(sd64, 2, x, sigma, time_conditioning=True)
    got = model(x, sigma=sigma)
    assert got.dtype == torch.float64 and ref.dtype == torch.float64
    assert float((got - ref).abs().max()) <= 1e-10 * float(ref.abs().max())
    _, cache = model.run_with_cache(x, sigma=sigma, names_filter=lambda n: n.endswith(("hook_normalized", "freqs")))
    assert cache and all(t.dtype == torch.float64 for t in cache.values())
