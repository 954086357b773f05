"""Held-out misuse, round seven (c): a hook that changes the activation's dtype or returns out-of-range expert ids
is refused naming the hook point; integer checkpoint tensors are refused by every loader; the unknown-architecture
message lists the real dispatch table; over-long names are a typed error; received attention refuses mass on keys
the declared mask hides; probes warn about right padding without a mask; anchor-rule arguments another rule would
ignore are refused."""

from __future__ import annotations

import warnings

import pytest
import torch

from mdm_lens import HookedMDM
from mdm_lens.errors import InputError
from tests.families.bd3gidd_checkpoints import write_bd3lm, write_gidd
from tests.families.ddit_checkpoints import MDLM_CONFIG, write_ddit
from tests.families.family_checkpoints import write_llada2


@pytest.fixture(scope="module")
def tiny():
    return HookedMDM.from_pretrained("mdm-lens/tiny-mdm")


@pytest.fixture(scope="module")
def llada2(tmp_path_factory):
    folder, _, _ = write_llada2(tmp_path_factory.mktemp("l2r7c"))
    return HookedMDM.from_pretrained(str(folder), load_tokenizer=False)


@pytest.fixture(scope="module")
def mdlm(tmp_path_factory):
    folder, _ = write_ddit(tmp_path_factory.mktemp("mdlmr7c"), MDLM_CONFIG)
    return HookedMDM.from_pretrained(str(folder), load_tokenizer=False)


# --- 1. a hook returning another dtype -----------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["tiny", "llada2", "mdlm"])
@pytest.mark.parametrize("cast", [torch.float64, torch.float16])
def test_a_hook_changing_the_dtype_is_refused_naming_the_hook_point(which, cast, request):
    model = request.getfixturevalue(which)
    tokens = torch.tensor([[5, 7, 9, 11]])
    with pytest.raises(InputError, match=r"the hook on blocks\.0\.hook_resid_pre returned a tensor of dtype "
                                         rf"{cast}, expected the activation's dtype torch\.float32") as err:
        model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_resid_pre", lambda r, hook: r.to(cast))])
    assert err.value.argument == "fwd_hooks"
    kept = model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_resid_pre", lambda r, hook: r.double().float())])
    assert torch.equal(kept, model(tokens))  # casting back is the documented fix, and changes nothing


# --- 2. expert ids out of range ------------------------------------------------------------------------------------

@pytest.mark.parametrize("edit, shown", [(lambda a: a + 100, r"\[10\d, 10\d\]"), (lambda a: a - 8, r"\[-\d, -\d\]"),
                                         (lambda a: a.clone().fill_(8), r"\[8, 8\]")])
def test_expert_ids_outside_the_experts_are_refused(llada2, edit, shown):
    tokens = torch.tensor([[5, 7, 9, 11]])
    name = "blocks.1.mlp.hook_expert_indices"  # layer 0 is dense (first_k_dense_replace=1)
    with pytest.raises(InputError, match=rf"the hook on {name} returned ids in {shown}; expected expert ids in "
                                         r"\[0, 8\) \(this layer has 8 experts\)") as err:
        llada2.run_with_hooks(tokens, fwd_hooks=[(name, lambda a, hook: edit(a))])
    assert err.value.allowed == "ids in [0, 8)"
    # in range (every token sent to experts 0 and 1) still runs, and changes the output
    routed = llada2.run_with_hooks(tokens, fwd_hooks=[(name, lambda a, hook: torch.stack(
        [torch.zeros_like(a[..., 0]), torch.ones_like(a[..., 0])], -1))])
    assert not torch.equal(routed, llada2(tokens))


def test_expert_ids_of_another_dtype_are_refused(llada2):
    name = "blocks.1.mlp.hook_expert_indices"
    with pytest.raises(InputError, match=rf"the hook on {name} returned a tensor of dtype torch\.int32, expected "
                                         r"the activation's dtype torch\.int64"):
        llada2.run_with_hooks(torch.tensor([[5, 7, 9, 11]]), fwd_hooks=[(name, lambda a, hook: a.int())])


def test_bridge_expert_ids_are_checked_against_its_experts():
    from mdm_lens.bridge import TransformersBridge
    from mdm_lens.bridge.tiny import tiny_diffusion_gemma

    bridge = TransformersBridge(tiny_diffusion_gemma(seed=0, num_experts=4))
    ids, canvas = torch.tensor([[2, 5, 7, 9]]), torch.tensor([[11, 12, 13, 14, 15, 16, 17, 18]])
    with torch.no_grad(), pytest.raises(InputError, match=r"the hook on blocks\.0\.mlp\.hook_expert_indices returned "
                                                          r"ids in \[4, 7\]; expected expert ids in \[0, 4\)"):
        bridge.run_with_hooks(ids, decoder_input_ids=canvas,
                              fwd_hooks=[("blocks.0.mlp.hook_expert_indices", lambda a, hook: a % 4 + 4)])


# --- 3. integer checkpoint tensors ---------------------------------------------------------------------------------

def _retype(folder, key_part: str, dtype: torch.dtype) -> str:
    """Rewrite the first tensor whose name contains `key_part` (in whichever weight file holds it) as `dtype`."""
    from safetensors.torch import load_file, save_file

    for f in sorted(folder.glob("*.safetensors")):
        weights = load_file(str(f))
        key = next((k for k in weights if key_part in k), None)
        if key is not None:
            weights[key] = (weights[key] * 100).to(dtype)
            save_file(weights, str(f), metadata={"format": "pt"})
            return key
    raise AssertionError(f"no tensor named like {key_part!r}")


def _write_case(case: str, folder):
    from tests.families.family_checkpoints import write_sdar
    from tests.families.nemotron_fixture import write_nemotron

    if case == "sdar":
        return write_sdar(folder)[0], "model.embed_tokens.weight"
    if case == "llada2":
        return write_llada2(folder)[0], "model.word_embeddings.weight"
    if case == "nemotron":
        return write_nemotron(folder)[0], "embed_tokens.weight"
    if case == "native":
        from mdm_lens.loading import save_pretrained

        save_pretrained(HookedMDM.from_pretrained("mdm-lens/tiny-mdm"), folder)
        return folder, "embed.W_E"
    if case == "mdlm":
        return write_ddit(folder, MDLM_CONFIG)[0], "vocab_embed"
    if case == "bd3lm":
        return write_bd3lm(folder)[0], "vocab_embed"
    if case == "gidd":
        return write_gidd(folder)[0], "vocab_embed"
    from mdm_lens.bridge.tiny import tiny_diffusion_gemma

    tiny_diffusion_gemma(seed=2).save_pretrained(str(folder))
    return folder, "embed_tokens.weight"


@pytest.mark.parametrize("case", ["sdar", "llada2", "nemotron", "native", "mdlm", "bd3lm", "gidd", "diffusion_gemma"])
@pytest.mark.parametrize("dtype, shown", [(torch.int32, "int32|I32"), (torch.bool, "bool|BOOL")])
def test_an_integer_checkpoint_tensor_is_refused_by_name(case, dtype, shown, tmp_path):
    from mdm_lens.errors import CheckpointError

    folder, part = _write_case(case, tmp_path / case)
    key = _retype(folder, part, dtype)
    with pytest.raises(CheckpointError, match=rf"tensor\(s\) {key} \(({shown})\) in .* are not floating point"):
        HookedMDM.from_pretrained(str(folder), load_tokenizer=False)


# --- 4. the unknown-architecture message is the dispatch table -----------------------------------------------------

def _dispatch(raw: dict, folder) -> str:
    """The family `from_pretrained` would load a folder with this config.json as (its dispatch order)."""
    import json

    from mdm_lens.bridge.loading import bridged_architecture
    from mdm_lens.ddit.hub import hub_family
    from mdm_lens.ddit.loading import folder_family
    from mdm_lens.loading import _family

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    if bridged_architecture(folder):
        return "diffusion_gemma"
    return hub_family(folder) or folder_family(folder) or _family(raw, folder / "config.json")


def test_every_listed_name_dispatches_to_its_family(tmp_path):
    from mdm_lens.loading.dispatch import NATIVE_MODEL_TYPE, dispatched

    archs, types = dispatched()
    # the families that were missing from the hand-written list
    assert {"NemotronLabsDiffusionModel", "MDLM", "DUO", "BD3LM", "DIT", "DiffusionGemmaForBlockDiffusion"} <= set(archs)
    for i, (name, family) in enumerate(archs.items()):
        assert _dispatch({"architectures": [name]}, tmp_path / f"a{i}") == family, name
    for i, (name, family) in enumerate(types.items()):
        if name != NATIVE_MODEL_TYPE:  # read_config reads mdm_lens' own format before any family dispatch
            assert _dispatch({"model_type": name}, tmp_path / f"t{i}") == family, name


def test_the_unknown_architecture_error_names_every_supported_name(tmp_path):
    from mdm_lens.errors import ConfigError
    from mdm_lens.loading.dispatch import dispatched

    with pytest.raises(ConfigError, match="is not a supported family") as err:
        _dispatch({"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox"}, tmp_path / "x")
    archs, types = dispatched()
    for name in [*archs, *types]:
        assert name in str(err.value), name


# --- 5. over-long names --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["a" * 5000, "org/" + "b" * 5000, "/tmp/" + "c" * 300, "~/" + "d" * 300])
def test_an_over_long_name_is_a_typed_error_naming_the_argument(name):
    from mdm_lens.errors import ArgumentError
    from mdm_lens.loading.resolve import resolve

    for call in (lambda: resolve(name), lambda: HookedMDM.from_pretrained(name)):
        with pytest.raises(ArgumentError, match=r"name_or_path='.*… \(\d+ characters\)' is not a usable path "
                                                r"\(File name too long\)") as err:
            call()
        assert err.value.argument == "name_or_path"


@pytest.mark.parametrize("check, name", [("output_file", "path"), ("output_folder", "folder")])
def test_an_over_long_output_path_is_a_typed_error(check, name):
    from mdm_lens import validate
    from mdm_lens.errors import ArgumentError

    with pytest.raises(ArgumentError, match=rf"{name}='.*' is not a usable path") as err:
        getattr(validate, check)("/tmp/" + "e" * 400, name=name)
    assert err.value.argument == name


def test_an_over_long_items_file_is_a_typed_error():
    from mdm_lens.errors import ArgumentError
    from mdm_lens.sweep.items import read_items

    with pytest.raises(ArgumentError, match=r"data='.*' is not a usable path"):
        read_items("f" * 400 + ".jsonl")


# --- 6. received attention under a mask the pattern does not follow ------------------------------------------------

def _bidirectional(n: int = 4) -> torch.Tensor:
    return torch.full((1, n, n), 1.0 / n, dtype=torch.float64)  # uniform over every key: half of it is "future"


@pytest.mark.parametrize("kw, arg, declared, worst", [
    (dict(causal=True), "causal", "causal=True", "0.75"),                         # row 0 puts 3/4 on keys 1..3
    (dict(block_length=2), "block_length", "block_length=2", "0.5"),             # rows 0-1 put 2/4 on block 1
    (dict(block_length=2, causal=True), "block_length", "block_length=2 and causal=True", "0.75")])
def test_mass_on_keys_the_declared_mask_hides_is_refused(kw, arg, declared, worst):
    from mdm_lens.errors import ArgumentError
    from mdm_lens.probes.floating import received_attention

    with pytest.raises(ArgumentError, match=rf"pattern puts up to {worst} of a query row's mass on keys that "
                                            rf"{declared} hides") as err:
        received_attention(_bidirectional(), **kw)
    assert err.value.argument == arg


def test_a_pattern_that_follows_its_mask_and_padding_aside_is_accepted():
    from mdm_lens.probes.floating import received_attention, uniform_pattern

    causal = uniform_pattern(4, causal=True)[None]
    m = received_attention(causal, causal=True)
    assert torch.allclose(m, torch.tensor([[25 / 48, 13 / 48, 7 / 48, 3 / 48]], dtype=torch.float64))
    assert torch.allclose(m.sum(-1), torch.ones(1, dtype=torch.float64))
    # mass on a padding key (key_visible False) is not "hidden by the mask": ignored as before
    padded = causal.clone()
    padded[0, 0, :2] = 0.5  # row 0 puts half its mass on key 1: a future key, but also a pad key
    visible = torch.tensor([[True, False, True, True]])
    got = received_attention(padded, key_visible=visible, causal=True)  # rows 0, 2, 3
    assert torch.allclose(got, torch.tensor([[13 / 36, 0.0, 7 / 36, 3 / 36]], dtype=torch.float64))
    # a row outside the query set may put mass anywhere
    rows = torch.tensor([[False, True, True, True]])
    leaky = causal.clone()
    leaky[0, 0] = 0.25
    assert torch.allclose(received_attention(leaky, query_mask=rows, causal=True),
                          received_attention(causal, query_mask=rows, causal=True))


# --- 7. right padding without a mask in the probes -----------------------------------------------------------------

def _right_padded(model):
    from mdm_lens.probes._runtools import generate_final

    prompts = [model.to_tokens("The capital of France is")[0], model.to_tokens("Hi")[0]]
    tokens, mask, _ = generate_final(model, prompts, gen_length=4, steps=4)
    assert int(tokens[1, -1]) == model.cfg.pad_token_id == 0 and int(mask[1].sum()) < tokens.shape[1]
    return tokens, mask


def _pad_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "end in the pad id" in str(w.message)]


@pytest.mark.parametrize("probe", ["absorption_by_layer", "final_attention", "qk_at_layer", "masked_kl"])
def test_right_padded_tokens_without_a_mask_warn_once(tiny, probe):
    from mdm_lens.lens.tuned import masked_kl
    from mdm_lens.probes.absorption import absorption_by_layer, final_attention
    from mdm_lens.probes.run import qk_at_layer

    tokens, mask = _right_padded(tiny)
    call = {"absorption_by_layer": lambda **kw: absorption_by_layer(tiny, tokens, **kw),
            "final_attention": lambda **kw: final_attention(tiny, tokens, **kw),
            "qk_at_layer": lambda **kw: qk_at_layer(tiny, tokens, 0, **kw),
            "masked_kl": lambda **kw: masked_kl(tiny, tokens, **kw)}[probe]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        call()
    start = int(mask[1].sum())
    assert _pad_warnings(record) == [
        f"{probe}: 1 row(s) of tokens (e.g. row 1, pads from position {start}) end in the pad id 0 but no "
        "attention_mask was given, so those pads are counted as real tokens (queries and keys). Pass the mask "
        f"(generate_final returns it: `tokens, mask, _ = generate_final(...)`; `{probe}(..., attention_mask=mask)`)."]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        call(attention_mask=mask)
    assert _pad_warnings(record) == []


def test_absorption_with_and_without_the_mask_differ_and_samplers_do_not_warn(tiny):
    from mdm_lens.probes.absorption import absorption_by_layer

    tokens, mask = _right_padded(tiny)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        unmasked = absorption_by_layer(tiny, tokens).per_sample
    masked = absorption_by_layer(tiny, tokens, attention_mask=mask).per_sample
    assert not torch.allclose(unmasked[1], masked[1])  # the pads were counted: the warning is not noise
    assert torch.allclose(unmasked[0], masked[0])      # the full row is the same either way
    with warnings.catch_warnings(record=True) as record:  # a sampler's canvas may end in pad ids: no warning
        warnings.simplefilter("always")
        tiny.generate(torch.tensor([[1, 5, 0, 0]]), gen_length=4, steps=4)
    assert _pad_warnings(record) == []


# --- 8. anchor-rule arguments another rule would ignore ------------------------------------------------------------

RECEIVED = torch.tensor([[0.40, 0.05, 0.30, 0.05, 0.20]], dtype=torch.float64)


@pytest.mark.parametrize("kw, rule, shown", [
    (dict(k=3), "zscore", "k=3 is ignored with rule='zscore': only the topk rule keeps k keys"),
    (dict(k=2), "gu", "k=2 is ignored with rule='gu'"),
    (dict(eps=0.1), "topk", "eps=0.1 is ignored with rule='topk': it sets the threshold of the other rules"),
    (dict(floor=1.0), "paper_temporal", "floor=1.0 is ignored with rule='paper_temporal': only the zscore rule"),
    (dict(kind="cumulative"), "rulli", "kind='cumulative' is ignored with rule='rulli'")])
def test_detect_anchors_refuses_another_rules_argument(kw, rule, shown):
    from mdm_lens.errors import ArgumentError
    from mdm_lens.probes.floating import detect_anchors

    with pytest.raises(ArgumentError, match=shown.replace("(", r"\(").replace(")", r"\)")) as err:
        detect_anchors(RECEIVED, rule=rule, **kw)
    assert err.value.argument == next(iter(kw))


def test_the_arguments_a_rule_reads_still_work():
    from mdm_lens.probes.floating import detect_anchors

    assert detect_anchors(RECEIVED, rule="topk", k=3).tolist() == [[True, False, True, False, True]]
    assert detect_anchors(RECEIVED, rule="gu", eps=0.35).tolist() == [[True, False, False, False, False]]
    assert detect_anchors(RECEIVED, rule="gu", eps=0.45).tolist() == [[False] * 5]
    assert detect_anchors(RECEIVED, eps=0.5, floor=1.5).tolist() == [[True, False, False, False, False]]
    # the neutral values (the defaults) are accepted under every rule
    assert detect_anchors(RECEIVED, rule="topk", eps=None, floor=2.0, kind="mass").tolist() == \
        detect_anchors(RECEIVED, rule="topk").tolist()


def test_rule_arguments_are_refused_through_the_step_probes(tiny):
    from mdm_lens.errors import ArgumentError
    from mdm_lens.hooks import ReceivedAttention
    from mdm_lens.probes.run import anchors_over_steps, drift_from_output

    out = tiny.generate(tiny.to_tokens("The capital is"), steps=4, gen_length=4, record=[ReceivedAttention()])
    with pytest.raises(ArgumentError, match=r"k=3 is ignored with rule='zscore'"):
        anchors_over_steps(out, k=3)
    with pytest.raises(ArgumentError, match=r"eps=0\.2 is ignored with rule='topk'"):
        anchors_over_steps(out, rule="topk", eps=0.2)
    with pytest.raises(ArgumentError, match=r"k=2 is ignored with rule='paper_qk'"):
        drift_from_output(out, rule="paper_qk", k=2)
    assert anchors_over_steps(out, rule="topk", k=2).anchors.sum(-1).eq(2).all()


def test_absorption_variants_refuses_a_rule_beside_given_anchors():
    from mdm_lens.errors import ArgumentError
    from mdm_lens.probes.floating import absorption_variants

    anchors = torch.tensor([[True, False, False, False, False]])
    with pytest.raises(ArgumentError, match=r"rule='topk' is ignored with anchors=") as err:
        absorption_variants(RECEIVED, anchors=anchors, rule="topk")
    assert err.value.argument == "rule"
    assert float(absorption_variants(RECEIVED, anchors=anchors).anchors) == pytest.approx(40.0)
