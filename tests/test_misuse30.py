"""Held-out misuse run 30 (issue #32 §3): each test fails on the code before its fix."""

from __future__ import annotations

import pytest
import torch

from mdm_lens import HookedMDM, probes
from mdm_lens.errors import ArgumentTypeError, InputError, OutOfRangeError, SamplerConfigError


@pytest.fixture(scope="module")
def tiny():
    return HookedMDM.from_pretrained("mdm-lens/tiny-mdm")


@pytest.mark.parametrize("index", [(0, 0, slice(None), 128), (0, 0, 128), (0, 0, slice(None), -129),
                                   (Ellipsis, 200), (0, Ellipsis, -129)])
def test_weight_views_refuse_an_int_index_past_a_matrix_axis(tiny, index):
    """S1: TL turns an int on the d_model axes into a one-wide slice, so one past the end gave an empty matrix."""
    d = tiny.cfg.d_model
    for view in (tiny.OV, tiny.QK):
        with pytest.raises(OutOfRangeError, match=rf"out of range for a weight view .* takes \[-{d}, {d - 1}\]"):
            view[index]
    with pytest.raises(OutOfRangeError, match=r"axis 1 takes \[-128, 127\]"):
        tiny.OV[0, 0][:, 128]
    # in range: unchanged (an int on a matrix axis keeps TL's one-wide slice)
    assert tuple(tiny.OV[0, 0, :, d - 1].shape) == (d, 1)  # (an in-range `...` index: TL 3.9 refuses it itself)
    torch.testing.assert_close(tiny.OV[1, 2, 5].AB, tiny.OV[1, 2].AB[5:6])


@pytest.mark.parametrize("bad", [None, "run.pkl", torch.zeros(2)])
def test_cache_effect_names_a_non_run_as_such(tiny, bad):
    """U1: read as 'this None run has no KV cache'."""
    with pytest.raises(ArgumentTypeError, match="is not what model.generate returns") as err:
        probes.cache_effect(tiny, bad)
    assert err.value.argument == "out"


def test_a_ragged_list_of_prompts_says_how_to_batch(tiny):
    """U3: torch's 'expected sequence of length 6 at dim 1 (got 4)'."""
    with pytest.raises(ArgumentTypeError, match=r"rows have different lengths \[6, 4\].*left-padded.*attention_mask"):
        tiny.generate([[5, 9, 17, 22, 30, 11], [7, 8, 12, 13]], steps=4, gen_length=4)
    with pytest.raises(ArgumentTypeError, match="must be text or token ids"):
        tiny.generate([[5, 9], "x"], steps=4, gen_length=4)


@pytest.mark.parametrize("ending", ["\n", "\r\n", ""])
def test_a_malformed_jsonl_line_names_its_column(tmp_path, ending):
    """U4: the column was counted after the line's newline ('column 1')."""
    from mdm_lens.sweep.items import read_items

    data = tmp_path / "bad.jsonl"
    data.write_bytes(('{"id": "x", "question": "q"' + ending).encode())
    with pytest.raises(InputError, match=r"bad\.jsonl:1: not valid json \(Expecting ',' delimiter at column 28\)"):
        read_items(data)


def test_an_out_of_range_hook_step_is_named_as_hook_steps(tiny):
    """U5: hook_steps=[9] was reported as 'steps[0]=9', which reads as the valid steps=4."""
    from mdm_lens import at_steps, steps

    hook = ("blocks.0.hook_resid_post", lambda x, hook: x)
    with pytest.raises(SamplerConfigError, match=r"^hook_steps\[0\]=9 is invalid") as err:
        tiny.generate(torch.tensor([[5, 9, 17]]), steps=4, gen_length=4, fwd_hooks=[hook], hook_steps=[9])
    assert err.value.argument == "hook_steps[0]"
    with pytest.raises(SamplerConfigError, match=r"^the hook on blocks\.0\.hook_resid_post: steps\[0\]=9 is invalid"):
        tiny.generate(torch.tensor([[5, 9, 17]]), steps=4, gen_length=4,
                      fwd_hooks=[at_steps(hook[1], [9], name=hook[0])])
    with pytest.raises(SamplerConfigError, match=r"^cache: steps\[0\]=0 and steps\[1\]=-4 both name step 0"):
        tiny.generate(torch.tensor([[5, 9, 17]]), steps=4, gen_length=4, cache=hook[0] @ steps(0, -4))


def test_a_runs_model_argument_must_be_a_model(tiny):
    """Same class as U1, found while sweeping it: `out.replay('model', 0)` raised AttributeError on `.cfg`."""
    out = tiny.generate([[5, 6, 7]], gen_length=4, steps=4)
    for call in (lambda: out.check_model(99), lambda: out.replay("model", 0), lambda: out.state_at(0) and
                 out.at_step(None, 0).__enter__()):
        with pytest.raises(ArgumentTypeError, match="is not a model"):
            call()


def test_a_layer_listed_twice_is_named_in_plain_words(tiny):
    """misuse30 note: 'expected distinct layer of 4s'."""
    from mdm_lens.hooks import ReceivedAttention

    with pytest.raises(OutOfRangeError, match=r"layers=\[0, -4\] is invalid: expected each layer of 4 at most once"):
        tiny.generate([[5, 6, 7]], gen_length=2, steps=1, record=[ReceivedAttention(layers=[0, -4])])
