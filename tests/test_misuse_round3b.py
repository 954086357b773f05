"""Round 3b of misuse checks (model core, weights, loading, cache): each case pins a class of input that used to
slip through (a plausible result, or a raw error deep inside) and now raises a typed error naming the argument."""

import torch
import pytest

from mdm_lens import HookedMDM, MDMConfig
from mdm_lens.errors import NonFiniteError
from tests.families.family_checkpoints import write_llada2
from mdm_lens.loading import read_config

CFG = dict(d_model=32, n_layers=2, n_heads=4, d_mlp=48, d_vocab=50, mask_token_id=49)


def small(**over):
    return HookedMDM.from_config(MDMConfig(**{**CFG, **over}), seed=1, init_std=0.3, init="realistic")


@pytest.fixture(scope="module")
def llada2(tmp_path_factory):
    folder, _, _ = write_llada2(tmp_path_factory.mktemp("l2"))
    cfg, _ = read_config(folder, "l2", None)
    return HookedMDM.from_config(cfg, seed=2, init_std=0.3, init="realistic")


def _nan(t, hook):
    return t * float("nan")


# --- finding 1: NaN written into q/k by a hook surfaces (SDPA used to return zeros for those rows) -----------------
@pytest.mark.parametrize("point", ["hook_q", "hook_k", "hook_rot_q", "hook_rot_k"])
@pytest.mark.parametrize("which", ["dense", "llada2"])
def test_nan_in_hooked_qk_is_not_hidden_by_sdpa(point, which, llada2):
    m = small() if which == "dense" else llada2
    v = m.cfg.d_vocab - 2
    x = torch.randint(0, v, (1, 8), generator=torch.Generator().manual_seed(0))
    out = m.run_with_hooks(x, fwd_hooks=[(f"blocks.0.attn.{point}", _nan)])
    assert out.isnan().all()  # every query reads a NaN key (bidirectional/block attention of layer 0)
    with pytest.raises(NonFiniteError, match="step 0"):
        m.generate(x[:, :4], steps=4, gen_length=4, fwd_hooks=[(f"blocks.0.attn.{point}", _nan)]) \
            if which == "dense" else m.generate(x[:, :4], gen_length=4,
                                                fwd_hooks=[(f"blocks.0.attn.{point}", _nan)])


def test_finite_hooked_qk_keeps_sdpa_and_matches_explicit():
    """A finite hook on q keeps the fast path (no T² pattern for a cache of hook_q) and agrees with the explicit path."""
    m = small()
    x = torch.randint(0, 48, (2, 9), generator=torch.Generator().manual_seed(3))
    double = lambda t, hook: t * 2.0  # noqa: E731
    fast = m.run_with_hooks(x, fwd_hooks=[("blocks.1.attn.hook_q", double)])
    for b in m.blocks:
        b.attn.force_explicit = True
    try:
        slow = m.run_with_hooks(x, fwd_hooks=[("blocks.1.attn.hook_q", double)])
    finally:
        for b in m.blocks:
            b.attn.force_explicit = False
    assert torch.allclose(fast, slow, atol=1e-5 * float(slow.detach().abs().max()))
    assert not torch.allclose(fast, m(x), atol=1e-3)  # the hook did change the output


# --- finding 8: functional in-place forms and out= into a read-only view are writes too ------------------------------
_F = torch.nn.functional
_WRITES = {
    "relu": lambda m: _F.relu(m.W_Q, inplace=True),
    "leaky_relu": lambda m: _F.leaky_relu(m.W_O, 0.1, inplace=True),
    "dropout_gqa_W_K": lambda m: _F.dropout(m.blocks[0].attn.W_K, p=1.0, training=True, inplace=True),
    "relu_missing_b_O": lambda m: _F.relu(m.blocks[0].attn.b_O, inplace=True),
    "hardtanh_alias": lambda m: _F.hardtanh(m.W_V[0, 1], inplace=True),
    "threshold": lambda m: _F.threshold(m.W_in, 0.0, 0.0, inplace=True),
    "alpha_dropout": lambda m: _F.alpha_dropout(m.W_out, 0.5, True, inplace=True),
    "silu": lambda m: _F.silu(m.b_Q, inplace=True),
    "out_kwarg_second": lambda m: torch.add(torch.ones(m.W_Q.shape), 1.0, out=m.W_Q),
    "out_tuple": lambda m: torch.max(torch.ones(m.W_gate.shape), dim=-1, out=(m.W_gate[:, :, 0], torch.empty(0, dtype=torch.long))),
    "torch_relu_": lambda m: torch.relu_(m.W_Q),
}


@pytest.mark.parametrize("case", list(_WRITES))
def test_inplace_functional_write_into_read_only_view_raises(case):
    from mdm_lens.errors import ReadOnlyViewError

    m = small(n_kv_heads=2)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(ReadOnlyViewError, match="read-only weight view"):
        _WRITES[case](m)
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())  # refused before any write


def test_out_of_place_functional_on_read_only_view_still_reads():
    m = small(n_kv_heads=2)
    y = _F.relu(m.W_Q, inplace=False)
    assert torch.equal(y, m.W_Q.clamp(min=0)) and type(y) is torch.Tensor  # a fresh tensor, writable
    y.add_(1.0)


# --- finding 11: cfg.n_params follows weight processing (norm weights folded away, o_bias made) ------------------
@pytest.mark.parametrize("which", ["qkv_bias", "llada2"])
@pytest.mark.parametrize("flags", [dict(), dict(fold_ln=False), dict(fold_value_biases=False),
                                   dict(fold_ln=True, center_unembed=False, fold_value_biases=True)])
def test_n_params_equals_parameter_count_after_processing(which, flags, llada2):
    import copy

    base = small(qkv_bias=True) if which == "qkv_bias" else llada2
    m = copy.deepcopy(base).process_weights_(**flags)
    assert m.cfg.n_params == sum(p.numel() for p in m.parameters())
    assert base.cfg.n_params == sum(p.numel() for p in base.parameters())
    if which == "qkv_bias" and not flags:  # planted: 5 norms of d=32 gone, 2 layers gain a d=32 o_bias
        assert base.cfg.n_params - m.cfg.n_params == 5 * 32 - 2 * 32


# --- the UNCLEAR save/reload of a processed model: refused at save, saying why -------------------------------------
def test_save_pretrained_refuses_a_processed_model(tmp_path):
    from mdm_lens.errors import ArgumentError
    from mdm_lens.loading import save_pretrained

    m = small(qkv_bias=True).process_weights_(center_unembed=False, fold_value_biases=False)
    with pytest.raises(ArgumentError, match=r"processed \(fold_ln\).*from_pretrained\(\.\.\., fold_ln=True\)"):
        save_pretrained(m, tmp_path / "x")
    assert not (tmp_path / "x").exists()  # refused before anything is written
    save_pretrained(small(), tmp_path / "ok")  # unprocessed still saves


# --- findings 12 and 18: from_pretrained's keywords ------------------------------------------------------------------
@pytest.mark.parametrize("flag", ["fold_ln", "center_unembed", "fold_value_biases"])
@pytest.mark.parametrize("value", [None, 0.0, 0, "", 1])
@pytest.mark.parametrize("loader", ["from_pretrained", "from_pretrained_no_processing"])
def test_processing_flags_must_be_bools(flag, value, loader):
    from mdm_lens.errors import ArgumentTypeError

    with pytest.raises(ArgumentTypeError, match=f"{flag}={value!r} is invalid: expected True or False"):
        getattr(HookedMDM, loader)("mdm-lens/tiny-mdm", **{flag: value})


@pytest.mark.parametrize("loader", ["from_pretrained", "from_pretrained_no_processing"])
@pytest.mark.parametrize("key,hint", [("fold_layernorm", "Did you mean fold_ln="), ("dtyp", "Did you mean dtype="),
                                      ("center_writing_weights", "TransformerLens option"),
                                      ("refactor_factored_attn_matrices", "TransformerLens option")])
def test_unknown_from_pretrained_keyword_is_named(loader, key, hint):
    from mdm_lens.errors import ArgumentError

    with pytest.raises(ArgumentError, match=f"unknown keyword {key}=True.*{hint}.*Accepted: dtype, device") as e:
        getattr(HookedMDM, loader)("mdm-lens/tiny-mdm", **{key: True})
    assert not isinstance(e.value, TypeError) and e.value.argument == key


# --- finding 14: the rotary cache follows cfg edits (theta, scaling) ----------------------------------------------
def _fresh_like(m):
    import copy

    fresh = HookedMDM(copy.deepcopy(m.cfg))
    fresh.load_state_dict(m.state_dict())
    return fresh.eval()


@pytest.mark.parametrize("edit", ["theta", "linear", "llama3"])
def test_rotary_cache_follows_config_edits(edit):
    m = small(n_ctx=64)
    x = torch.randint(0, 48, (1, 12), generator=torch.Generator().manual_seed(4))
    before = m(x).detach()
    if edit == "theta":
        m.cfg.rope_theta = 10.0
    elif edit == "linear":
        m.cfg.extra["rope_scaling"] = {"rope_type": "linear", "factor": 4.0}
    else:
        m.cfg.extra["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 4}
    after = m(x).detach()
    want = _fresh_like(m)(x).detach()  # a model built with the edited config from the start
    assert torch.allclose(after, want, atol=1e-5 * float(want.abs().max()))
    assert (after - before).abs().max() > 1e-3  # the edit matters on this input


def test_rotary_cache_follows_edits_on_the_trained_twin():
    m = HookedMDM.from_pretrained("mdm-lens/tiny-mdm")
    x = torch.randint(0, m.cfg.d_vocab - 2, (1, 10), generator=torch.Generator().manual_seed(5))
    m(x)
    m.cfg.rope_theta = m.cfg.rope_theta / 100
    want = _fresh_like(m)(x).detach()
    assert torch.allclose(m(x).detach(), want, atol=1e-5 * float(want.abs().max()))


# --- finding 21: tokens_to_residual_directions refuses what is not token ids -----------------------------------------
@pytest.mark.parametrize("bad", [["a", "b"], None, 3.5, [1, None], {"a": 1}, [[1, "x"]]])
def test_tokens_to_residual_directions_refuses_non_ids(bad):
    from mdm_lens.errors import InputTypeError

    m = small()
    with pytest.raises(InputTypeError, match=r"tokens=.* is invalid: expected an int, a str, or an integer tensor"):
        m.tokens_to_residual_directions(bad)


def test_tokens_to_residual_directions_still_takes_nested_ids():
    m = small()
    d = m.tokens_to_residual_directions([[1, 2], [3, 4]])
    assert d.shape == (2, 2, 32) and torch.equal(d[1, 0], m.tokens_to_residual_directions(3))


# --- finding 17: run_with_cache(incl_bwd=True) needs a scalar output ---------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    return HookedMDM.from_pretrained("mdm-lens/tiny-mdm")


def _masked(m):
    clean = torch.randint(0, m.cfg.d_vocab - 2, (1, 8), generator=torch.Generator().manual_seed(6))
    x = clean.clone()
    x[:, 3:] = m.cfg.mask_token_id
    return x, clean


@pytest.mark.parametrize("kw", [dict(), dict(return_type="logits"), dict(return_type="both", with_targets=True),
                                dict(return_type="loss", with_targets=True, loss_per_token=True),
                                dict(return_type="aligned")])
def test_incl_bwd_with_a_non_scalar_output_is_refused(kw, tiny):
    from mdm_lens.errors import InputError

    x, clean = _masked(tiny)
    kw = dict(kw)
    if kw.pop("with_targets", False):
        kw["targets"] = clean
    with pytest.raises(InputError, match="incl_bwd=True needs a scalar output.*return_type='loss' without "
                                         "loss_per_token"):
        tiny.run_with_cache(x, incl_bwd=True, **kw)
    assert all(not hp.fwd_hooks and not hp.bwd_hooks for hp in tiny.hook_dict.values())  # refused before hooking


def test_incl_bwd_with_the_scalar_loss_still_caches_gradients(tiny):
    x, clean = _masked(tiny)
    loss, cache = tiny.run_with_cache(x, return_type="loss", targets=clean, incl_bwd=True,
                                      names_filter="blocks.0.hook_resid_post")
    assert loss.ndim == 0 and cache["blocks.0.hook_resid_post_grad"].abs().sum() > 0


# --- finding 24: the TL residual helpers on our cache name the layer range --------------------------------------------
@pytest.mark.parametrize("helper", ["accumulated_resid", "decompose_resid", "get_full_resid_decomposition",
                                    "stack_head_results"])
@pytest.mark.parametrize("layer", [99, 5, -2])
def test_cache_resid_helpers_refuse_out_of_range_layers(helper, layer, tiny):
    from mdm_lens.errors import OutOfRangeError

    tiny.set_use_attn_result(True)
    try:
        _, cache = tiny.run_with_cache(_masked(tiny)[0])
    finally:
        tiny.set_use_attn_result(False)
    assert tiny.cfg.n_layers == 4
    with pytest.raises(OutOfRangeError, match=rf"{helper}\(layer={layer}\) is out of range.*\[0, 4\]"):
        getattr(cache, helper)(layer=layer)


def test_cache_resid_helpers_keep_tl_layer_meanings(tiny):
    _, cache = tiny.run_with_cache(_masked(tiny)[0])
    final = cache["blocks.3.hook_resid_post"]
    for layer in (None, -1, 4):
        assert torch.allclose(cache.accumulated_resid(layer)[-1], final)
        assert torch.allclose(cache.decompose_resid(layer).sum(0), final, atol=1e-4)
    assert cache.accumulated_resid(2).shape[0] == 3  # embed + resid_pre 1, 2


# --- findings 20, 4 and 11 (extra keys): our own config.json is checked like an HF one ----------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory, llada2):
    from mdm_lens.loading import save_pretrained

    root = tmp_path_factory.mktemp("native")
    return {"dense": save_pretrained(small(), root / "dense"), "llada2": save_pretrained(llada2, root / "llada2")}


_NATIVE_EDITS = [
    ("dense", {"extra": None}, r"extra=None is invalid: expected a JSON object"),
    ("dense", {"extra": [1, 2]}, r"extra=\[1, 2\] is invalid"),
    ("dense", {"dtype": "float128"}, r"dtype='float128' is invalid: expected one of float32"),
    ("dense", {"normalization_type": "LN"},
     r"normalization_type=.LN. is invalid: HookedMDM implements normalization_type=.RMS. only"),
    ("dense", {"normalization_type": None}, r"normalization_type=None is invalid"),
    ("dense", {"normalization_type": "RMSPre"}, r"RMSPre marks a processed model"),
    ("dense", {"act_fn": "gelu"}, r"act_fn='gelu' is invalid"),
    ("dense", {"positional_embedding_type": "standard"}, r"positional_embedding_type='standard' is invalid"),
    ("dense", {"attn_only": True}, r"attn_only=True is invalid"),
    ("dense", {"extra.rotary_dim": 3}, r"extra.rotary_dim=3 is invalid"),
    ("dense", {"extra.rope_scaling": {"rope_type": "dynamic", "factor": 2}}, r"extra.rope_scaling=.* rope_type one of"),
    ("dense", {"extra.rope_scaling": {"type": "bogus"}}, r"extra.rope_scaling=.* rope_type one of"),
    ("dense", {"extra.rope_scaling": {"rope_type": "llama3", "factor": 2}}, r"low_freq_factor=None"),
    ("dense", {"extra.rope_scaling": {"rope_type": "linear", "factor": float("nan")}}, r"factor=nan"),
    ("dense", {"extra.o_bias": True}, r"extra.o_bias=True is only built by the family blocks"),
    ("dense", {"extra.qk_norm": True}, r"extra.qk_norm=True is only built by the family blocks"),
    ("dense", {"extra.moe": {"n_experts": 4}}, r"extra.moe=.* is only built by the family blocks"),
    ("dense", {"extra.clip_qkv": 3.0}, r"extra.clip_qkv=3.0 is only built"),
    ("llada2", {"extra.rotary_dim": 3}, r"extra.rotary_dim=3 is invalid: expected an even int in \(0, d_head=16\]"),
    ("llada2", {"extra.rotary_dim": 100}, r"extra.rotary_dim=100 is invalid"),
    ("llada2", {"extra.moe_layers": [False]}, r"extra.moe_layers=\[False\] is invalid: expected a list of 3 "),
    ("llada2", {"extra.arch": "bogus"}, r"extra.arch='bogus' is invalid"),
]


@pytest.mark.parametrize("which,edit,match", _NATIVE_EDITS)
def test_native_config_values_are_checked(which, edit, match, saved, tmp_path):
    import json
    import shutil

    from mdm_lens.errors import ConfigError

    folder = tmp_path / which
    shutil.copytree(saved[which], folder)
    raw = json.loads((folder / "config.json").read_text())
    for key, value in edit.items():
        if key.startswith("extra."):
            raw["extra"][key.removeprefix("extra.")] = value
        else:
            raw[key] = value
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=match) as e:
        HookedMDM.from_pretrained(folder, load_tokenizer=False)
    assert "config.json" in str(e.value)  # names the file


def test_native_round_trip_still_loads_exactly(saved, llada2):
    x = torch.randint(0, 60, (1, 7), generator=torch.Generator().manual_seed(7))
    for which, want in (("dense", small()), ("llada2", llada2)):
        got = HookedMDM.from_pretrained(saved[which], load_tokenizer=False)
        assert torch.allclose(got(x % want.cfg.d_vocab), want(x % want.cfg.d_vocab), atol=1e-6)
