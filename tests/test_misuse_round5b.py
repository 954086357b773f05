"""Issue #32, held-out user round 5 (placement, memory plan, variable-length / special ids): S1, S4, S5, S6, C4, C5,
C6, C7 and the UNCLEAR lines on DreamOn masks, memory_plan arguments, device_map='cpu' and probes without a record.
Each finding is tested on its listed case and on its class (every weight view / processing function on a model
with a disk block; every sampler reading special ids × each collision)."""

from __future__ import annotations

import contextlib
import sys
import warnings
from pathlib import Path

import pytest
import torch

from mdm_lens import HookedMDM, MDMConfig
from mdm_lens.diffusion import MaskedAnswerWarning
from mdm_lens.errors import (ArgumentError, ArgumentTypeError, ConfigError, InputError, OffloadedWeightsError,
                             SamplerConfigError)
from mdm_lens.loading import save_pretrained
from mdm_lens.loading.placement_checks import check_max_memory
from mdm_lens import probes, validate

sys.path.insert(0, str(Path(__file__).parent / "families"))  # the family writers import each other by module name
from family_checkpoints import MASK_ID, write_llada2  # noqa: E402
from rnd1_coda_checkpoints import write_rnd1  # noqa: E402

CFG = dict(d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_mlp=48, d_vocab=50, mask_token_id=49, n_ctx=64,
           qkv_bias=True, eos_token_id=1, pad_token_id=0)  # GQA and q/k/v biases: not the defaults


@contextlib.contextmanager
def count_forwards(model):
    """Counts embedding forwards (every model forward runs it); the hook is always removed."""
    calls = []
    handle = model.embed.register_forward_hook(lambda *a: calls.append(1))
    try:
        yield calls
    finally:
        handle.remove()


# --- S1 / C5: operations on offloaded weights -------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("off")
    model = HookedMDM.from_config(MDMConfig(**CFG), seed=0, init_std=0.3, init="realistic")
    save_pretrained(model, root / "m")
    return root


def _offloaded(saved, name="off"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return HookedMDM.from_pretrained(str(saved / "m"), load_tokenizer=False,
                                         device_map={"": "cpu", "blocks.1": "disk"}, offload_folder=saved / name)


def test_s1_fold_ln_with_a_disk_block_is_refused_naming_it(saved):
    with pytest.raises(OffloadedWeightsError, match=r"blocks\.1 \(disk\)"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            HookedMDM.from_pretrained(str(saved / "m"), load_tokenizer=False, fold_ln=True,
                                      device_map={"": "cpu", "blocks.1": "disk"}, offload_folder=saved / "f")
    mo = _offloaded(saved)
    x = torch.randint(0, 49, (1, 8))
    before = mo(x)
    with pytest.raises(OffloadedWeightsError, match="process_weights_"):
        mo.process_weights_()
    assert mo.blocks[1].ln1.w is not None and mo.blocks[0].ln1.w is not None  # refused before any fold
    torch.testing.assert_close(mo(x), before, rtol=0, atol=0)
    assert not any(getattr(mo, "weight_processing", {}).values())


@pytest.mark.parametrize("read", [
    lambda m: m.W_Q, lambda m: m.W_K, lambda m: m.W_V, lambda m: m.W_O, lambda m: m.b_Q, lambda m: m.b_V,
    lambda m: m.b_O, lambda m: m.W_in, lambda m: m.W_gate, lambda m: m.W_out, lambda m: m.OV, lambda m: m.QK,
    lambda m: m.all_composition_scores("Q"), lambda m: m.blocks[1].attn.W_Q,
    lambda m: m.blocks[1].attn.W_Q.add_(1), lambda m: m.blocks[1].attn.b_K, lambda m: m.blocks[1].mlp.W_in,
    lambda m: m.blocks[1].mlp.W_out.mul_(2),
    lambda m: m.process_weights_(fold_ln=False, center_unembed=False, fold_value_biases=True),
    lambda m: save_pretrained(m, "/nonexistent/never-written"),
], ids=["W_Q", "W_K", "W_V", "W_O", "b_Q", "b_V", "b_O", "W_in", "W_gate", "W_out", "OV", "QK", "composition",
        "attn.W_Q", "attn.W_Q.add_", "attn.b_K", "mlp.W_in", "mlp.W_out.mul_", "fold_value_biases", "save"])
def test_c5_every_weight_reader_on_a_disk_block_is_a_typed_error(saved, read):
    mo = _offloaded(saved)
    with pytest.raises(OffloadedWeightsError, match=r"blocks\.1") as err:
        read(mo)
    assert isinstance(err.value, RuntimeError) and "from_pretrained" in str(err.value)


@pytest.mark.parametrize("view", ["W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O", "W_in", "W_gate", "W_out"])
def test_c5_resident_blocks_views_equal_the_resident_model(saved, view):
    mo = _offloaded(saved)
    resident = HookedMDM.from_pretrained(str(saved / "m"), load_tokenizer=False)
    sub = "mlp" if view in ("W_in", "W_gate", "W_out") else "attn"
    for layer in (0, 2):
        got = getattr(getattr(mo.blocks[layer], sub), view)
        torch.testing.assert_close(got, getattr(getattr(resident.blocks[layer], sub), view), rtol=0, atol=0)
    torch.testing.assert_close(mo.W_U, resident.W_U, rtol=0, atol=0)
    torch.testing.assert_close(mo.W_E, resident.W_E, rtol=0, atol=0)


def test_c5_offloaded_unembed_and_embed_are_named(saved):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mo = HookedMDM.from_pretrained(str(saved / "m"), load_tokenizer=False,
                                       device_map={"": "cpu", "unembed": "disk", "embed": "disk"},
                                       offload_folder=saved / "eu")
    for read, name in [(lambda m: m.W_U, "unembed"), (lambda m: m.W_E, "embed"),
                       (lambda m: m.accumulated_bias(1), "embed"), (lambda m: m.b_U, "unembed"),
                       (lambda m: m.tokens_to_residual_directions(3), "unembed")]:
        with pytest.raises(OffloadedWeightsError, match=name):
            read(mo)


def test_c5_shipped_twin_with_a_disk_block(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mo = HookedMDM.from_pretrained("mdm-lens/tiny-mdm", device_map={"": "cpu", "blocks.0": "disk"},
                                       offload_folder=tmp_path)
    with pytest.raises(OffloadedWeightsError, match=r"blocks\.0"):
        mo.OV
    with pytest.raises(OffloadedWeightsError, match=r"blocks\.0"):
        mo.process_weights_(fold_ln=True, center_unembed=False, fold_value_biases=False)


# --- S4 / S5 / S6 / C4: special ids that collide, checked at sampler time -------------------------------------
@pytest.fixture(scope="module")
def rnd1(tmp_path_factory):
    folder, _, _ = write_rnd1(tmp_path_factory.mktemp("rnd1") / "rnd1")
    return HookedMDM.from_pretrained(str(folder))


@pytest.mark.parametrize("ids", [dict(eos_token_id=MASK_ID), dict(pad_token_id=MASK_ID)], ids=["eos", "pad"])
def test_s4_rnd1_eos_or_pad_equal_to_mask_refused_before_any_forward(rnd1, ids):
    (name, _), = ids.items()
    with count_forwards(rnd1) as calls, pytest.raises(SamplerConfigError, match=f"mask_token_id={MASK_ID} and "
                                                                               f"{name}={MASK_ID}") as err:
        rnd1.generate(torch.tensor([[5, 6, 7]]), gen_length=6, seed=0, **ids)
    assert calls == [] and err.value.argument == name


def test_s4_rnd1_distinct_ids_still_run(rnd1):
    out = rnd1.generate(torch.tensor([[5, 6, 7]]), gen_length=6, steps=6, seed=0, greedy=True)
    assert not bool((out.tokens[0, 3:-1] == MASK_ID).all())


DEL, SPLIT = 96, 97


@pytest.fixture(scope="module")
def indel(tmp_path_factory):
    folder, _, _ = write_llada2(tmp_path_factory.mktemp("indel") / "ll2", delete_token_id=DEL, split_token_id=SPLIT,
                                block_length=4)
    return HookedMDM.from_pretrained(str(folder))


@pytest.mark.parametrize("extra, names", [
    (dict(delete_token_id=DEL, split_token_id=DEL), ("delete_token_id", "split_token_id")),
    (dict(delete_token_id=MASK_ID, split_token_id=SPLIT), ("delete_token_id", "mask_token_id")),
    (dict(delete_token_id=DEL, split_token_id=MASK_ID), ("split_token_id", "mask_token_id")),
], ids=["delete==split", "delete==mask", "split==mask"])
def test_s5_indel_edit_id_collisions_refused_before_any_forward(indel, extra, names):
    saved = dict(indel.cfg.extra)
    indel.cfg.extra.update(extra)
    try:
        with count_forwards(indel) as calls, pytest.raises(SamplerConfigError) as err:
            indel.generate(torch.tensor([[5, 6, 7, 8]]), sampler="indel", gen_length=8, block_length=4, seed=0)
    finally:
        indel.cfg.extra.clear()
        indel.cfg.extra.update(saved)
    assert calls == [] and all(n in str(err.value) for n in names)


def test_s5_loader_and_sampler_share_the_check(tmp_path):
    with pytest.raises(ConfigError, match="same token"):
        write_llada2(tmp_path / "bad", delete_token_id=DEL, split_token_id=DEL)
        HookedMDM.from_pretrained(str(tmp_path / "bad"))


def _dream():
    cfg = MDMConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_mlp=48, d_vocab=50, mask_token_id=49, n_ctx=128,
                    eos_token_id=1, pad_token_id=0, logit_shift=True, position_policy="cumsum", padding_mask="pair",
                    qkv_bias=True, extra={"expand_token_id": 48})
    model = HookedMDM.from_config(cfg, seed=2, init_std=0.3, init="realistic")
    with torch.no_grad():
        model.unembed.weight[49] = 0  # a trained model never predicts the mask itself
    return model


@pytest.mark.parametrize("extra, names", [
    (dict(delete_token_id=49), ("delete/EOS id", "cfg.mask_token_id")),
    (dict(expand_token_id=1), ("expand_token_id", "delete/EOS id")),
    (dict(expand_token_id=49), ("expand_token_id", "cfg.mask_token_id")),
    (dict(expand_token_id=7, delete_token_id=7), ("expand_token_id", "delete/EOS id")),
], ids=["delete==mask", "expand==eos", "expand==mask (C4)", "expand==delete"])
def test_s6_c4_dreamon_id_collisions_refused_before_any_forward(extra, names):
    model = _dream()
    model.cfg.extra.update(extra)
    with count_forwards(model) as calls, pytest.raises(SamplerConfigError) as err:
        model.generate(torch.tensor([[5, 6, 7, 8]]), sampler="dreamon", suffix=[9, 10], steps=16, seed=0)
    assert calls == [] and all(n in str(err.value) for n in names)


def test_unclear_dreamon_masks_left_in_the_span_warn():
    model = _dream()
    with pytest.warns(MaskedAnswerWarning, match="dreamon"):
        out = model.generate(torch.tensor([[5, 6, 7, 8]]), sampler="dreamon", suffix=[9, 10], steps=1, seed=0)
    assert bool((out.tokens == 49).any())


def test_distinct_ids_skips_unset_and_names_both():
    validate.distinct_ids({"a": 1, "b": None, "c": 2}, why="x")
    with pytest.raises(SamplerConfigError, match=r"a=3 and c=3") as err:
        validate.distinct_ids({"a": 3, "b": None, "c": 3}, why="x", error=SamplerConfigError)
    assert err.value.argument == "c" and err.value.value == 3


# --- C6 / C7 / UNCLEAR: max_memory, memory_plan arguments, device_map="cpu" -------------------------------------
@pytest.mark.parametrize("mm, kind, match", [
    ({"cpu": "10 parsecs"}, ArgumentError, r"max_memory\['cpu'\]='10 parsecs'"),
    ({"cpu": "1e3"}, ArgumentError, r"max_memory\['cpu'\]='1e3'.*'10GiB'"),
    ({"cpu": -5}, ArgumentError, r"max_memory\['cpu'\]=-5"),
    ({"cpu": 1.5}, ArgumentTypeError, r"max_memory\['cpu'\]=1.5"),
    ({"tpu": "1GiB"}, ArgumentError, "'tpu' is not a device"),
])
def test_c6_max_memory_values_refused_at_load(saved, mm, kind, match):
    with pytest.raises(kind, match=match):
        HookedMDM.from_pretrained(str(saved / "m"), load_tokenizer=False, device_map="auto", max_memory=mm)


def test_c6_max_memory_forms_accelerate_parses_load(saved):
    model = HookedMDM.from_pretrained(str(saved / "m"), load_tokenizer=False, device_map="auto",
                                      max_memory={"cpu": "1GiB"})
    assert model.hf_device_map == {"": "cpu"}
    assert check_max_memory({"cpu": " 2 GB", "disk": 0, "cuda:0": "1MiB"}, real=False) == {"cpu": "2 GB", "disk": 0,
                                                                                          0: "1MiB"}


def test_c6_memory_plan_max_memory_checked(saved):
    model = HookedMDM.from_pretrained(str(saved / "m"), load_tokenizer=False)
    p = torch.tensor([[2, 3, 4]])
    with pytest.raises(ArgumentError, match=r"max_memory\['cpu'\]=-1"):
        model.memory_plan(p, steps=2, gen_length=4, max_memory={"cpu": -1})
    if torch.cuda.device_count() < 4:
        with pytest.raises(ArgumentError, match=r"max_memory\['cuda:3'\] names GPU 3"):
            model.memory_plan(p, steps=2, gen_length=4, max_memory={"cuda:3": "1KiB"})
    plan = model.memory_plan(p, steps=2, gen_length=4, max_memory={"cpu": "1KiB"})
    assert not plan.fits  # the weights alone exceed 1 KiB: the budget was read, not ignored


def test_c7_memory_plan_text_without_tokenizer_is_generates_error(saved):
    model = HookedMDM.from_pretrained(str(saved / "m"), load_tokenizer=False)
    with pytest.raises(InputError, match="no tokenizer"):
        model.generate("hello", steps=2, gen_length=4)
    with pytest.raises(InputError, match="no tokenizer"):
        model.memory_plan("hello", steps=2, gen_length=4)


def test_unclear_memory_plan_validates_as_generate(saved):
    model = HookedMDM.from_pretrained(str(saved / "m"), load_tokenizer=False)
    p = torch.tensor([[2, 3, 4]])
    for call in (model.generate, model.memory_plan):
        with pytest.raises(ArgumentTypeError, match="record='x'"):
            call(p, steps=2, gen_length=4, record="x")
        with pytest.raises(SamplerConfigError, match="exceeds the context of 64"):
            call(p, steps=2, gen_length=1000)
    with pytest.raises(SamplerConfigError, match="exceeds the context of 64"):
        model.memory_plan(prompt_length=3, steps=2, gen_length=62)
    assert model.memory_plan(prompt_length=3, steps=2, gen_length=61) is not None  # 64 positions: allowed


def test_unclear_device_map_plain_device_accepted(saved):
    x = torch.randint(0, 49, (1, 8))
    model = HookedMDM.from_pretrained(str(saved / "m"), load_tokenizer=False, device_map="cpu")
    assert model.hf_device_map == {"": "cpu"}
    torch.testing.assert_close(model(x), HookedMDM.from_pretrained(str(saved / "m"), load_tokenizer=False)(x),
                               rtol=0, atol=0)
    with pytest.raises(ArgumentError, match="device_map"):
        HookedMDM.from_pretrained(str(saved / "m"), load_tokenizer=False, device_map="gpu-ish")


# --- UNCLEAR: probes on a run without the record ------------------------------------------------------------------
@pytest.mark.parametrize("probe", [probes.drift_from_output, probes.anchors_over_steps])
def test_unclear_probe_without_record_says_how_to_record(saved, probe):
    model = HookedMDM.from_pretrained(str(saved / "m"), load_tokenizer=False)
    out = model.generate(torch.tensor([[2, 3, 4]]), steps=2, gen_length=4, seed=0)
    with pytest.raises(ArgumentError, match=r"recorded no 'received_attention'.*record=\[ReceivedAttention\(\)\]"):
        probe(out)


def test_max_memory_gpu_index_must_exist_on_this_machine(monkeypatch):
    """With N GPUs the indices are 0..N-1: index N is refused (naming the key), N-1 accepted."""
    from mdm_lens.errors import ArgumentError
    from mdm_lens.loading.placement_checks import check_max_memory

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert check_max_memory({1: "1GiB", "cpu": 10}, real=True) is not None
    for key in (2, "cuda:2"):
        with pytest.raises(ArgumentError, match="max_memory"):
            check_max_memory({key: "1GiB"}, real=True)
    assert check_max_memory({5: "1GiB"}, real=False) is not None  # planning for another machine: any index


@pytest.mark.parametrize("value, valid", [("10GiBx", "10GiB"), ("10Gbit", "10GB"), ("5MB of RAM", "5MB")])
def test_max_memory_size_strings_with_trailing_text_are_refused(value, valid):
    from mdm_lens.errors import ArgumentError
    from mdm_lens.loading.placement_checks import check_max_memory

    with pytest.raises(ArgumentError, match=r"max_memory\['cpu'\]"):
        check_max_memory({"cpu": value}, real=False)
    assert check_max_memory({"cpu": valid}, real=False) == {"cpu": valid}


def test_distinct_ids_treats_id_0_as_an_id():
    """Token id 0 is a real id (often pad or a special token), not "unset": two roles at 0 collide."""
    from mdm_lens.errors import ArgumentError
    from mdm_lens.validate import distinct_ids

    with pytest.raises(ArgumentError, match="mask_id=0 and eos_id=0"):
        distinct_ids({"mask_id": 0, "eos_id": 0, "pad_id": None}, why="planted.")
    distinct_ids({"mask_id": 0, "eos_id": 1, "pad_id": None}, why="planted.")
