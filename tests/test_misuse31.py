"""Held-out misuse run 31 (issue #32 §3): each test fails on the code before its fix."""

from __future__ import annotations

import pytest
import torch

from mdm_lens import HookedMDM, KeyValueNorms, ReceivedAttention, TopKKeys
from mdm_lens.errors import ArgumentTypeError, InputError, OutOfRangeError


@pytest.fixture(scope="module")
def tiny():
    return HookedMDM.from_pretrained("mdm-lens/tiny-mdm")


@pytest.mark.parametrize("record", [[ReceivedAttention(name="key_norms"), KeyValueNorms()],
                                    [TopKKeys(), ReceivedAttention(name="topk_keys")],
                                    [KeyValueNorms(), KeyValueNorms(name="kv2")]])
def test_two_reducers_writing_one_record_key_are_refused(tiny, record):
    """S1: a reducer named like another's output key was silently overwritten (the record vanished)."""
    with pytest.raises(InputError, match="both write the record") as err:
        tiny.generate([[5, 6, 7]], steps=2, gen_length=2, record=record)
    assert err.value.argument == "record"


def test_distinct_record_keys_all_arrive(tiny):
    out = tiny.generate([[5, 6, 7]], steps=2, gen_length=2,
                        record=[KeyValueNorms(), ReceivedAttention(), TopKKeys(k=2)])
    assert set(out.records) == {"key_norms", "value_norms", "received_attention", "topk_attention", "topk_keys"}


@pytest.fixture(scope="module")
def cache(tiny):
    return tiny.run_with_cache(torch.randint(5, 300, (1, 8), generator=torch.Generator().manual_seed(0)))[1]


@pytest.mark.parametrize("key,match", [(("pattern", 0, "ln1"), "layer_type='ln1' is not where 'pattern' lives"),
                                       (("z", 1, "mlp"), "layer_type='mlp' is not where 'z' lives"),
                                       (("pattern", 0, "attn", 1), r"a key is \(name, layer\[, layer_type\]\)")])
def test_cache_keys_refuse_a_wrong_layer_type_and_extra_parts(cache, key, match):
    """S2: TL's get_act_name dropped a wrong layer_type; C1: a 4-part key raised its raw TypeError."""
    with pytest.raises(ArgumentTypeError, match=match):
        cache[key]


def test_cache_keys_with_the_right_layer_type_still_resolve(cache):
    for key, name in ((("pattern", 0, "attn"), "blocks.0.attn.hook_pattern"),
                      (("pattern", 0, "a"), "blocks.0.attn.hook_pattern"),
                      (("normalized", 1, "ln2"), "blocks.1.ln2.hook_normalized"),
                      (("resid_pre", 2, "b"), "blocks.2.hook_resid_pre")):
        assert torch.equal(cache[key], cache[name])


def test_blocks_and_experts_indexed_past_the_end_name_the_range(tiny, tmp_path):
    """C2: torch's bare 'IndexError: index 9 is out of range'."""
    import sys
    from pathlib import Path

    with pytest.raises(OutOfRangeError, match=r"expected a layer of these 4 in \[-4, 3\]"):
        tiny.blocks[9]
    assert tiny.blocks[-1] is tiny.blocks[3] and len(tiny.blocks[1:3]) == 2
    sys.path.insert(0, str(Path(__file__).parent / "families"))
    from family_checkpoints import write_llada2

    moe = HookedMDM.from_pretrained(str(write_llada2(tmp_path / "l2")[0]), load_tokenizer=False)
    layer = moe.cfg.extra["moe_layers"].index(True)
    experts = moe.blocks[layer].mlp.experts
    with pytest.raises(OutOfRangeError, match=rf"expected an expert of these {len(experts)}"):
        experts[len(experts)]


def test_a_list_of_token_tensors_says_to_stack_them(tiny):
    """U1: the message ended in torch's 'only integer tensors of a single element can be converted to an index'."""
    with pytest.raises(ArgumentTypeError, match="prompt is a list of tensors: stack them"):
        tiny.generate([torch.tensor([1, 5, 32]), torch.tensor([1, 5, 9])], steps=4, gen_length=4)


def test_a_named_received_attention_record_is_pointed_to(tiny):
    """U2: the readers advised re-running generate, though record='ra2' was the fix."""
    from mdm_lens.errors import ArgumentError
    from mdm_lens.probes.run import anchors_over_steps, drift_from_output

    out = tiny.generate(torch.tensor([[1, 5, 32, 49, 50, 34]]), steps=4, gen_length=4,
                        record=[ReceivedAttention(name="ra2")])
    for read in (anchors_over_steps, drift_from_output):
        with pytest.raises(ArgumentError, match=r"\['ra2'\] hold\(s\) received attention .*pass record='ra2'"):
            read(out, layer=0)
    assert anchors_over_steps(out, layer=0, record="ra2").anchors.shape[-2] == 4


def test_the_bridges_stacks_name_the_range_too():
    pytest.importorskip("transformers.models.diffusion_gemma")
    from mdm_lens.bridge import TransformersBridge
    from mdm_lens.bridge.tiny import tiny_diffusion_gemma

    bridge = TransformersBridge(tiny_diffusion_gemma(seed=0))
    n = len(bridge.blocks)
    assert bridge.blocks[-1] is bridge.blocks[n - 1]
    for stack, what in ((bridge.blocks, "a layer"), (bridge.encoder, "an encoder layer")):
        with pytest.raises(OutOfRangeError, match=rf"expected {what} of these {len(stack)}"):
            stack[len(stack)]
