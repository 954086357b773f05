"""An independent check of `sampler="llada2"`: diffusers 0.42's `LLaDA2Pipeline` + `BlockRefinementScheduler`
driving the same HookedMDM (tiny LLaDA2 checkpoint) through `diffusers_adapter.py`, same seed.

Token-exact where both implement the same thing: greedy, `threshold`, `steps` / `block_length`,
temperature + top_k + top_p with a seed, `minimal_topk`, `eos_early_stop`, and LLaDA2.1's editing
(`editing_threshold`, `max_post_steps`; diffusers' mapping: `num_inference_steps = 2 * block_length` gives the
schedule 1,...,1,0,... = dllm's `num_to_transfer=1` without ending the block before its post-fill edits).

Where diffusers differs, `mdm_lens` follows the dllm reference (ZHZisZZ/dllm @ ca176752, `generate()` of
`modeling_llada2_moe.py` / `modeling_llada21_moe.py`; `test_family_samplers.py` checks ours against transcriptions
of those loops), and each difference is asserted exactly below as a diffusers quirk:

1. After a block's last mask is filled before its last scheduled step, diffusers runs one more forward (its
   `while` loop samples before noticing the block is full); dllm's `for` loop breaks first. Harmless when greedy;
   with temperature it draws from the generator, so later blocks differ.
2. Without `eos_early_stop`, dllm stops after the block that holds an EOS (always); diffusers decodes on.
3. Its 2-D attention mask hides the canvas slots past `prompt_length + gen_length` (the last block's tail) as keys;
   dllm's block mask leaves them visible. Only a ragged last block is affected.
4. LLaDA2.1: diffusers runs `max_post_steps + 1` post-fill forwards where dllm runs `max_post_steps`; a block
   filled exactly at its last scheduled step gets no post-fill editing forward; `editing_threshold=0.0` disables
   editing (dllm edits any changed token with p > 0); with `eos_early_stop` diffusers stops right after the
   forward that commits an EOS with everything before it decoded, where dllm's 2.1 loop finishes (and edits) the
   block and stops after it only when the generated part holds no mask.
Not covered: `num_to_transfer > 1` with post-fill editing (no diffusers schedule expresses it).

The model runs in fp32; diffusers builds no float mask (no bf16 cast: that cast is dllm's `generate`'s)."""

from __future__ import annotations

import pytest
import torch
from family_checkpoints import MASK_ID, write_llada2

from mdm_lens import HookedMDM
from mdm_lens.diffusion.generate import generate

diffusers = pytest.importorskip("diffusers", minversion="0.42",
                                reason="diffusers >= 0.42 (LLaDA2Pipeline) is not installed: pip install -e '.[dev]'")
from diffusers_adapter import HookedMDMForDiffusers  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # near_one: the planted EOS tokens and quirk scenarios below were picked from these weights' outputs (the
    # forward itself is checked on realistic weights in test_family_forward.py)
    folder = write_llada2(tmp_path_factory.mktemp("diffusers_llada2") / "llada2", init="near_one")[0]
    return HookedMDM.from_pretrained(folder)


def _prompt(n: int) -> torch.Tensor:
    return torch.randint(0, 90, (1, n), generator=torch.Generator().manual_seed(n))


def _ours(model, monkeypatch, prompt, eos=98, **kw):
    monkeypatch.setattr(model.cfg, "eos_token_id", eos)
    return generate(model, prompt, sampler="llada2", seed=0, **kw)


def _diffusers(model, prompt, *, block_length, steps, eos=98, hide_tail=True, editing_threshold=None,
               eos_early_stop=False, **kw):
    """(generated tokens [1, gen_length], the adapter's forward log) of LLaDA2Pipeline with seed 0."""
    adapter = HookedMDMForDiffusers(model, block_length, hide_tail=hide_tail)
    pipe = diffusers.LLaDA2Pipeline(model=adapter, scheduler=diffusers.BlockRefinementScheduler())
    pipe.set_progress_bar_config(disable=True)
    out = pipe(input_ids=prompt, use_chat_template=False, block_length=block_length, num_inference_steps=steps,
               editing_threshold=editing_threshold, eos_early_stop=eos_early_stop, eos_token_id=eos,
               mask_token_id=MASK_ID, generator=torch.Generator().manual_seed(0), output_type="seq", **kw)
    return out.sequences, adapter.calls


def _diffusers_forwards(out, case) -> int:
    """Ours' forward count plus one for each block filled before its last scheduled step (quirk 1), except a
    block where eos_early_stop ended the run."""
    steps = min(case["steps"], case["gen_length"] // case.get("minimal_topk", 1))
    per_block = torch.bincount(out.trajectory.block_of_step).tolist()
    early = [n < steps for n in per_block]
    if case.get("eos_early_stop"):
        early[-1] = False
    return out.trajectory.n_steps + sum(early)


CASES = [  # (prompt + gen_length) whole blocks; every block fills exactly at its last step where sampling
    dict(prompt=8, gen_length=8, block_length=4, steps=4),
    dict(prompt=4, gen_length=8, block_length=4, steps=3, threshold=0.05),
    dict(prompt=8, gen_length=12, block_length=4, steps=4, temperature=0.8, top_k=6, top_p=0.9),
    dict(prompt=4, gen_length=12, block_length=4, steps=8, temperature=1.0, minimal_topk=3),  # steps -> 4
    dict(prompt=8, gen_length=12, block_length=4, steps=4, temperature=0.7, eos=18, eos_early_stop=True),
    dict(prompt=8, gen_length=12, block_length=4, steps=4, temperature=0.7, eos=10, eos_early_stop=True),
]


@pytest.mark.parametrize("case", CASES)
def test_llada2_matches_diffusers(model, monkeypatch, case):
    case = dict(case)
    prompt = _prompt(case.pop("prompt"))
    p = prompt.shape[1]
    out = _ours(model, monkeypatch, prompt, **case)
    seq, calls = _diffusers(model, prompt, **case)
    assert torch.equal(out.tokens[:, p:], seq)
    assert len(calls) == _diffusers_forwards(out, case)  # ours' forwards plus quirk 1's no-op ones
    eos = case.get("eos", 98)
    if eos != 98:  # the planted EOS ends the answer in both (diffusers' decode trim is up to the first EOS)
        assert out.answer_length[0] == int((seq[0] == eos).nonzero()[0, 0]) + 1


def test_quirk_extra_forward_after_block_fills_greedy(model, monkeypatch):
    """threshold 0: each block fills in one step of two; diffusers then runs one more (no-op) forward per block."""
    prompt, kw = _prompt(8), dict(gen_length=8, block_length=4, steps=2, threshold=0.0)
    out = _ours(model, monkeypatch, prompt, **kw)
    seq, calls = _diffusers(model, prompt, **kw)
    assert torch.equal(out.tokens[:, 8:], seq)
    assert out.trajectory.n_steps == 2 and [w for w, _ in calls] == [12, 12, 16, 16]


def test_quirk_extra_forward_draws_from_the_generator(model, monkeypatch):
    """steps 6 > block_length 4: blocks fill after 4 steps; diffusers' extra forward per block samples (temperature
    1), so the first block agrees and the later ones do not."""
    prompt, kw = _prompt(4), dict(gen_length=12, block_length=4, steps=6, temperature=1.0)
    out = _ours(model, monkeypatch, prompt, **kw)
    seq, calls = _diffusers(model, prompt, **kw)
    assert out.trajectory.n_steps == 12 and len(calls) == 12 + 3
    assert torch.equal(out.tokens[:, 4:8], seq[:, :4]) and not torch.equal(out.tokens[:, 4:], seq)


def test_quirk_eos_without_early_stop_keeps_decoding(model, monkeypatch):
    """EOS 18 lands in the first block: dllm (and ours) stop after it, later blocks stay masked; diffusers decodes
    on exactly as if there were no EOS. The answer (up to the first EOS) is the same."""
    prompt, kw = _prompt(8), dict(gen_length=12, block_length=4, steps=4, temperature=0.7)
    out = _ours(model, monkeypatch, prompt, eos=18, **kw)
    seq, _ = _diffusers(model, prompt, eos=18, **kw)
    no_eos = _ours(model, monkeypatch, prompt, eos=98, **kw)
    gen = out.tokens[0, 8:]
    assert bool((gen[:4] == 18).any()) and bool((gen[4:] == MASK_ID).all())
    assert torch.equal(seq, no_eos.tokens[:, 8:]) and torch.equal(seq[0, :4], gen[:4])
    assert out.answer_length[0] == int((seq[0] == 18).nonzero()[0, 0]) + 1


def test_quirk_hidden_tail_of_a_ragged_last_block(model, monkeypatch):
    """prompt 6 + gen 9 = 15 slots in 4 blocks of 4: diffusers' padding mask hides slot 15 as a key in the last
    block's forwards. With the tail visible (adapter hide_tail=False) it equals ours; as shipped it differs, and
    only in the last block."""
    prompt, kw = _prompt(6), dict(gen_length=9, block_length=4, steps=4)
    out = _ours(model, monkeypatch, prompt, **kw)
    seq, calls = _diffusers(model, prompt, **kw)
    visible, _ = _diffusers(model, prompt, hide_tail=False, **kw)
    assert torch.equal(out.tokens[:, 6:], visible)
    assert not torch.equal(out.tokens[:, 6:], seq) and torch.equal(out.tokens[:, 6:12], seq[:, :6])
    assert {w for w, hid in calls if hid} == {16} and {w for w, hid in calls if not hid} == {8, 12}


def test_llada21_editing_matches_diffusers(model, monkeypatch):
    prompt = _prompt(6)
    kw = dict(gen_length=10, block_length=4, temperature=0.9, top_k=8, top_p=0.95, editing_threshold=0.5)
    out = _ours(model, monkeypatch, prompt, max_post_steps=16, **kw)
    seq, calls = _diffusers(model, prompt, steps=8, max_post_steps=16, **kw)
    assert torch.equal(out.tokens[:, 6:], seq) and len(calls) == out.trajectory.n_steps


def test_quirk_llada21_one_more_post_fill_forward(model, monkeypatch):
    """Edits keep changing (threshold 0.02) so the post-fill cap binds: diffusers with max_post_steps=2 equals ours
    (dllm) with 3, not with 2."""
    prompt, kw = _prompt(8), dict(gen_length=8, block_length=4, editing_threshold=0.02)
    seq, calls = _diffusers(model, prompt, steps=8, max_post_steps=2, **kw)
    three = _ours(model, monkeypatch, prompt, max_post_steps=3, **kw)
    two = _ours(model, monkeypatch, prompt, max_post_steps=2, **kw)
    assert torch.equal(three.tokens[:, 8:], seq) and len(calls) == three.trajectory.n_steps
    assert not torch.equal(two.tokens[:, 8:], seq) and two.trajectory.n_steps == len(calls) - 2


def test_quirk_llada21_no_post_fill_forward_after_the_last_scheduled_step(model, monkeypatch):
    """num_inference_steps = block_length: the schedule fills one mask per step, the block is full at its last
    scheduled step and diffusers ends it there — exactly 4 forwards per block, none to edit after filling."""
    prompt, kw = _prompt(8), dict(gen_length=8, block_length=4, editing_threshold=0.02)
    seq, calls = _diffusers(model, prompt, steps=4, max_post_steps=2, **kw)
    ours = _ours(model, monkeypatch, prompt, max_post_steps=2, **kw)
    assert [w for w, _ in calls] == [12] * 4 + [16] * 4 and ours.trajectory.n_steps > 8
    assert not bool((seq == MASK_ID).any()) and not torch.equal(ours.tokens[:, 8:], seq)


def test_quirk_llada21_editing_threshold_zero_disables_editing(model, monkeypatch):
    """diffusers reads editing_threshold=0.0 as "off" (LLaDA2.0's loop); dllm's 2.1 loop edits any changed token."""
    prompt, kw = _prompt(8), dict(gen_length=8, block_length=4)
    seq, _ = _diffusers(model, prompt, steps=4, editing_threshold=0.0, max_post_steps=3, **kw)
    plain = _ours(model, monkeypatch, prompt, steps=4, **kw)
    editing = _ours(model, monkeypatch, prompt, editing_threshold=0.0, max_post_steps=3, **kw)
    assert torch.equal(plain.tokens[:, 8:], seq) and not torch.equal(editing.tokens[:, 8:], seq)


@pytest.mark.parametrize("eos", [96, 18])
def test_quirk_llada21_eos_early_stop_mid_block(model, monkeypatch, eos):
    """diffusers' result is exactly dllm's canvas at the step where diffusers stopped: ours goes on editing and
    filling that block (96: then stops after it; 18: the EOS is edited away and decoding runs to the end)."""
    prompt = _prompt(6)
    kw = dict(gen_length=10, block_length=4, temperature=0.9, top_k=8, top_p=0.95, editing_threshold=0.5,
              max_post_steps=16, eos=eos, eos_early_stop=True)
    seq, calls = _diffusers(model, prompt, steps=8, **kw)
    out = _ours(model, monkeypatch, prompt, **kw)
    assert torch.equal(out.trajectory.x_steps[len(calls)][:, 6:], seq) and len(calls) < out.trajectory.n_steps
    start = (6 + int((seq[0] == eos).nonzero()[0, 0])) // 4 * 4  # canvas start of the block diffusers stopped in
    assert bool((seq[0, start - 6:start - 2] == MASK_ID).any())  # it left that block unfinished
    assert not bool((out.tokens[0, start:start + 4] == MASK_ID).any())  # dllm / ours finished it
