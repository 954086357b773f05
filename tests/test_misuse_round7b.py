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


# --- 2. TL weight processing and weight-analysis attributes: refused with the adaLN reason -------------------------
@pytest.mark.parametrize("flag", ["fold_ln", "center_unembed", "fold_value_biases"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_processing_flag_is_refused_before_loading_a_ddit_checkpoint(folders, family, flag, monkeypatch):
    from mdm_lens.ddit.model import HookedDDiT
    from mdm_lens.errors import ArgumentError
    from mdm_lens.loading import readers

    def no_read(*a, **k):  # the refusal comes before any weight is read
        raise AssertionError("a weight was read")

    monkeypatch.setattr(readers.CheckpointReader, "get", no_read)
    for load in (HookedMDM.from_pretrained, HookedDDiT.from_pretrained):
        with pytest.raises(ArgumentError, match="adaLN modulation") as err:
            load(str(folders[family]), load_tokenizer=False, **{flag: True})
        assert err.value.argument == flag and f"{family} checkpoint" in str(err.value)
    with pytest.raises(ArgumentError, match="adaLN modulation") as err:  # TL's name, on the DDiT loader
        HookedDDiT.from_pretrained(str(folders[family]), load_tokenizer=False, center_writing_weights=True)
    assert err.value.argument == "center_writing_weights"


def test_processing_flags_set_to_false_still_load(folders):
    from mdm_lens.ddit.model import HookedDDiT

    m = HookedMDM.from_pretrained(str(folders["mdlm"]), load_tokenizer=False, fold_ln=False, center_unembed=False)
    assert type(m).__name__ == "HookedDDiT"
    assert type(HookedDDiT.from_pretrained(str(folders["gidd"]), load_tokenizer=False, fold_ln=False)).__name__ == \
        "HookedGIDD"
    assert type(HookedDDiT.from_pretrained_no_processing(str(folders["duo"]), load_tokenizer=False)).__name__ == \
        "HookedDDiT"


@pytest.mark.parametrize("name, fragment", [("process_weights_", "adaLN modulation"), ("OV", "adaLN gate"),
                                            ("QK", "adaLN gate"), ("W_Q", "attn.qkv.weight"),
                                            ("W_O", "adaLN gate"), ("all_composition_scores", "adaLN gate"),
                                            ("W_in", "mlp.fc_in"), ("W_gate", "no gate"),
                                            ("tokens_to_residual_directions", "model.readout"),
                                            ("accumulated_bias", "adaLN gate"), ("untie_embeddings_", "never tied"),
                                            ("set_use_attn_result", "hook_attn_out")])
def test_tl_weight_analysis_attributes_are_refused_with_the_reason(folders, name, fragment):
    from mdm_lens.errors import UnsupportedAttributeError
    from mdm_lens.errors import ArgumentError

    for family in ("mdlm", "bd3lm"):
        model = _load(folders[family])
        with pytest.raises(UnsupportedAttributeError, match=fragment) as err:
            getattr(model, name)
        assert isinstance(err.value, ArgumentError) and isinstance(err.value, AttributeError)
        assert err.value.argument == name and type(model).__name__ in str(err.value)
        assert not hasattr(model, name) and getattr(model, name, None) is None  # still an AttributeError
    with pytest.raises(AttributeError, match="no attribute 'W_nonsense'"):  # other names: Python's own error
        model.W_nonsense


def test_every_tl_name_hookedmdm_has_is_defined_or_refused_on_ddit(folders):
    from mdm_lens.ddit.unsupported import UNSUPPORTED_ATTRIBUTES

    model = _load(folders["gidd"])
    missing = {n for n in dir(HookedMDM) if not n.startswith("_")} - set(dir(type(model)))
    assert missing <= set(UNSUPPORTED_ATTRIBUTES), sorted(missing - set(UNSUPPORTED_ATTRIBUTES))


# --- 3. HookedDDiT.from_pretrained loads BD3LM / GIDD folders (autocast included) ---------------------------------
@pytest.mark.parametrize("family, cls_name", [("bd3lm", "HookedBD3LM"), ("gidd", "HookedGIDD")])
def test_hookedddit_from_pretrained_loads_bd3lm_and_gidd_with_autocast(folders, family, cls_name):
    from mdm_lens.ddit.bd3lm import HookedBD3LM
    from mdm_lens.ddit.gidd import HookedGIDD
    from mdm_lens.ddit.model import HookedDDiT

    own = {"bd3lm": HookedBD3LM, "gidd": HookedGIDD}[family]
    fp32 = HookedDDiT.from_pretrained(str(folders[family]), load_tokenizer=False)
    bf16 = HookedDDiT.from_pretrained(str(folders[family]), load_tokenizer=False, autocast=True)
    assert type(fp32).__name__ == type(bf16).__name__ == cls_name and bf16.autocast and not fp32.autocast
    assert type(own.from_pretrained(str(folders[family]), load_tokenizer=False)).__name__ == cls_name
    x = torch.randint(0, fp32.cfg.d_vocab - 1, (2, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a, b = fp32(x, sigma=0.4), bf16(x, sigma=0.4)
    assert a.dtype == torch.float32 and b.dtype == torch.bfloat16  # the autocast path really ran (BD3LM too)
    assert float((a - b.float()).abs().mean() / a.abs().mean()) < 0.08
    other = HookedGIDD if family == "bd3lm" else HookedBD3LM
    from mdm_lens.errors import ConfigError

    with pytest.raises(ConfigError, match=f"{cls_name}.from_pretrained"):
        other.from_pretrained(str(folders[family]), load_tokenizer=False)
    with pytest.raises(ConfigError, match="loads into HookedDDiT"):
        own.from_pretrained(str(folders["mdlm"]), load_tokenizer=False)


def test_hookedmdm_from_pretrained_autocast_names_where_it_is_taken(folders):
    from mdm_lens.errors import ArgumentError

    with pytest.raises(ArgumentError, match=r"HookedDDiT.from_pretrained\(folder, autocast=True\)"):
        HookedMDM.from_pretrained(str(folders["mdlm"]), load_tokenizer=False, autocast=True)


# --- 4. save_pretrained refuses a DDiT model up front ---------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_save_pretrained_refuses_a_ddit_model_before_writing(folders, family, tmp_path):
    from mdm_lens.errors import ArgumentError
    from mdm_lens.loading import save_pretrained

    model = _load(folders[family])
    with pytest.raises(ArgumentError, match="copy that folder") as err:
        save_pretrained(model, tmp_path / "out")
    assert err.value.argument == "model" and type(model).__name__ in str(err.value)
    assert not (tmp_path / "out").exists()  # nothing half-written


# --- 5. BD3LM's block comes from config.json: refusals say so -------------------------------------------------------
def test_block_length_refusals_name_config_block_size_for_bd3lm_and_no_blocks_for_whole_canvas_samplers(folders,
                                                                                                       tmp_path):
    from mdm_lens.errors import SamplerConfigError
    from mdm_lens.sae.export import export_activations

    bd3 = _load(folders["bd3lm"])
    with pytest.raises(SamplerConfigError, match=r"config.json block_size") as err:
        export_activations(bd3, [[7, 8]], "blocks.0.hook_resid_post", out=tmp_path / "e", gen_length=14, n_steps=4,
                           block_length=8)
    assert err.value.argument == "block_length" and "number of forwards" not in str(err.value)
    with pytest.raises(SamplerConfigError, match=r"config.json block_size"):
        bd3.generate(torch.full((1, 2), 7), gen_length=14, steps=4, block_length=8)
    mdlm = _load(folders["mdlm"])
    with pytest.raises(SamplerConfigError, match="whole canvas") as err:
        export_activations(mdlm, [[7, 8]], "blocks.0.hook_resid_post", out=tmp_path / "m", gen_length=8, n_steps=4,
                           block_length=8)
    assert "number of forwards" not in str(err.value)


# --- 6. cache_effect on a BD3LM cached run: says which caches it covers ---------------------------------------------
def test_cache_effect_on_a_bd3lm_kv_run_says_it_covers_fastdllm_caches_only(folders):
    from mdm_lens.errors import InputError
    from mdm_lens.probes import cache_effect

    bd3 = _load(folders["bd3lm"])
    out = bd3.generate(torch.full((1, 1), 7), gen_length=15, steps=4, kv_cache=True)
    with pytest.raises(InputError, match=r"Fast-dLLM prefix / dual caches of LLaDA and Dream runs only") as err:
        cache_effect(bd3, out)
    assert "'bd3lm' run's cache (kv_cache=True) is another one" in str(err.value)
    assert "this run has kv_cache=True" not in str(err.value)
    plain = bd3.generate(torch.full((1, 1), 7), gen_length=15, steps=4)
    with pytest.raises(InputError, match=r"has no KV cache \(kv_cache=False\)"):
        cache_effect(bd3, plain)


# --- 7. the report prose never prints a raw nan ----------------------------------------------------------------------
class _LensSweep:
    def __init__(self, table):
        self.label, self._t = "planted", table

    def table(self, name):
        return self._t if name == "lens" else None


def test_report_lens_finding_says_undefined_when_no_token_emerged(tmp_path):
    import pandas as pd

    from mdm_lens.views.fig_lens import lens_section

    base = dict(item_id="a", answer_position=pd.NA, answer=pd.NA, note=None)
    rows = [dict(base, step=s, layer=0, metric="acc_masked", value=0.5) for s in (0, 1)]
    for p in range(3):  # three answer tokens, none of which ever emerged: emergence and lead NaN
        pos = dict(base, step=pd.NA, layer=0, answer_position=p, answer=True)
        rows += [dict(pos, metric="emergence_step", value=None), dict(pos, metric="lead", value=None)]
    t = pd.DataFrame(rows)
    t["value"] = t["value"].astype(float)
    for col in ("step", "layer", "answer_position"):
        t[col] = t[col].astype("Int64")
    t["answer"] = t["answer"].astype("boolean")
    sec = lens_section([_LensSweep(t)], tmp_path)
    assert "mean lead undefined (no token emerged)" in sec.finding
    assert "nan" not in sec.finding.lower() and "0% of answer tokens" in sec.finding


def test_figure_labels_never_print_nan():
    import math

    from mdm_lens.views.figstyle import finite_mean, shown

    assert shown(math.nan, ".2f") == "n/a" and shown(1.234, ".2f") == "1.23" and shown(None, ".1f", "x") == "x"
    assert math.isnan(finite_mean([math.nan, math.nan])) and finite_mean([1.0, math.nan, 3.0]) == 2.0


# --- 8. a reducer scheduled only on steps that reused MDLM's cache: an empty record, and readers say why ------------
def test_a_reducer_on_reuse_steps_only_keeps_an_empty_record_and_readers_say_the_cache_was_reused(folders):
    import mdm_lens
    from mdm_lens.errors import InputError
    from mdm_lens.probes import anchors_over_steps

    model = _load(folders["mdlm"])
    probe = model.generate(torch.full((1, 2), 7), gen_length=8, steps=8, predictor="ddpm_cache",
                           record=[mdm_lens.ReceivedAttention()])
    ran = probe.record_meta["received_attention"]["steps"]
    reused = [s for s in range(probe.n_steps) if s not in ran]
    assert reused, "the planted run must reuse the cache at some step"  # seed 0 of this checkpoint does (step 5)
    assert probe.record_meta["received_attention"]["no_forward"] == reused
    out = model.generate(torch.full((1, 2), 7), gen_length=8, steps=8, predictor="ddpm_cache",
                         record=[mdm_lens.ReceivedAttention(when=mdm_lens.steps(reused[0])),
                                 mdm_lens.TopKKeys(k=2, when=mdm_lens.steps(reused[0]))])
    assert tuple(out.records["received_attention"].shape) == (0, 1, model.cfg.n_layers, model.cfg.n_heads, 10)
    assert tuple(out.records["topk_keys"].shape) == (0, 1, model.cfg.n_layers, model.cfg.n_heads, 10, 2)
    meta = out.record_meta["received_attention"]
    assert meta["steps"] == [] and meta["no_forward"] == [reused[0]]
    with pytest.raises(InputError, match=rf"scheduled step\(s\) \[{reused[0]}\] reused the cache \(no forward") as err:
        anchors_over_steps(out)
    assert "record=[ReceivedAttention()]" not in str(err.value)  # not the advice to pass what was passed
    notes = out.explore(model).data[0]["notes"]
    assert any("reused the cache" in n for n in notes) and not any("generate with record=" in n for n in notes)
    # a schedule mixing a forward step and a reuse step keeps the forward's row and names the other
    mixed = model.generate(torch.full((1, 2), 7), gen_length=8, steps=8, predictor="ddpm_cache",
                           record=[mdm_lens.ReceivedAttention(when=mdm_lens.steps(ran[0], reused[0]))])
    assert mixed.record_meta["received_attention"]["steps"] == [ran[0]]
    assert mixed.record_meta["received_attention"]["no_forward"] == [reused[0]]
    assert anchors_over_steps(mixed).steps == [ran[0]]


def test_a_processing_flag_is_refused_before_loading_a_bridge_checkpoint(tmp_path):
    # the same mistake on the other class without weight processing (the transformers-native bridge): refused at
    # load, not after loading the whole model
    pytest.importorskip("transformers")
    from mdm_lens.bridge.tiny import tiny_diffusion_gemma
    from mdm_lens.errors import ArgumentError

    folder = tmp_path / "dg"
    tiny_diffusion_gemma(seed=2).save_pretrained(str(folder))
    with pytest.raises(ArgumentError, match="transformers-native checkpoint") as err:
        HookedMDM.from_pretrained(str(folder), fold_ln=True)
    assert err.value.argument == "fold_ln"
