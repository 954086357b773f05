"""Planted cases: LLaDA2's group-limited top-k, the two expert-bias semantics, and the block-causal mask
(blocks aligned at position 0, so a prompt's tail shares a block with the first generated tokens)."""

from __future__ import annotations

import pytest
import torch
from family_checkpoints import write_llada2, write_lladamoe

from mdm_lens import HookedMDM, masks
from mdm_lens.errors import ArgumentError
from mdm_lens.moe import select_experts


def test_group_limited_topk_prefers_the_best_group_over_the_best_experts():
    # groups {0,1} and {2,3}: group scores 0.9+0.1 = 1.0 and 0.5+0.45 = 0.95; one group may compete
    scores = torch.tensor([[0.9, 0.1, 0.5, 0.45]])
    assert select_experts(scores, 2, n_group=2, topk_group=1).tolist() == [[0, 1]]  # not expert 2 (0.5 > 0.1)
    assert select_experts(scores, 2).tolist() == [[0, 2]]  # plain top-k


def test_group_score_is_the_sum_of_the_two_best():
    # group 0 has one star (0.95) and weak members; group 1 two good ones: 0.95+0.05 = 1.0 < 0.6+0.55 = 1.15
    scores = torch.tensor([[0.95, 0.05, 0.01, 0.6, 0.55, 0.0]])
    assert select_experts(scores, 1, n_group=2, topk_group=1).tolist() == [[3]]


def test_tied_groups_are_both_kept():
    # groups 0 and 1 tie at 1.0, group 2 scores 0.2; topk_group=2 keeps both tied groups whatever the tie order
    scores = torch.tensor([[0.5, 0.5, 0.6, 0.4, 0.1, 0.1]])
    chosen = select_experts(scores, 3, n_group=3, topk_group=2)[0]
    assert chosen[0].item() == 2 and set(chosen.tolist()) == {0, 1, 2}


def test_select_experts_validates():
    scores = torch.rand(3, 6)
    with pytest.raises(ArgumentError, match="n_group"):
        select_experts(scores, 2, n_group=4, topk_group=1)  # 4 does not divide 6
    with pytest.raises(ArgumentError, match="top_k"):
        select_experts(scores, 7)
    with pytest.raises(ArgumentError, match="n_group"):
        select_experts(scores, 2, n_group=6, topk_group=2)  # one expert per group: no "two best"


def _route(model, tokens, layer):
    names = [f"blocks.{layer}.mlp.hook_{n}" for n in ("router_logits", "expert_indices", "expert_weights")]
    _, cache = model.run_with_cache(tokens, names_filter=names)
    return [cache[n] for n in names]


def test_llada2_expert_bias_changes_the_choice_not_the_weight(tmp_path):
    folder, config, _ = write_llada2(tmp_path / "llada2")
    model = HookedMDM.from_pretrained(folder)
    tokens = torch.randint(0, 100, (1, 9), generator=torch.Generator().manual_seed(1))
    mlp = model.blocks[1].mlp
    with torch.no_grad():
        mlp.expert_bias.zero_()
        _, plain, _ = _route(model, tokens, 1)
        star = 5
        assert not bool((plain == star).any(-1).all())  # unbiased, expert 5 is not everyone's pick
        mlp.expert_bias[star] = 10.0
        logits, index, weights = _route(model, tokens, 1)
    assert bool((index == star).any(-1).all())  # the bias forces the choice ...
    scores = torch.sigmoid(logits).gather(-1, index)  # ... but the weights are the unbiased sigmoid scores
    expected = scores / (scores.sum(-1, keepdim=True) + 1e-20) * config["routed_scaling_factor"]
    torch.testing.assert_close(weights, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(weights.sum(-1), torch.full((1, 9), 2.5), rtol=0, atol=1e-6)


def test_lladamoe_expert_bias_is_added_to_the_weights(tmp_path):
    folder, _, _ = write_lladamoe(tmp_path / "lladamoe")
    model = HookedMDM.from_pretrained(folder)
    tokens = torch.randint(0, 100, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model.blocks[2].mlp.expert_bias[3] = 0.5
        logits, index, weights = _route(model, tokens, 2)
    biased = torch.softmax(logits, -1) + model.blocks[2].mlp.expert_bias
    assert bool((index == 3).any(-1).all())
    torch.testing.assert_close(weights, biased.gather(-1, index), rtol=0, atol=1e-6)  # not renormalised
    assert bool((weights.sum(-1) > 0.5).all())


def test_block_causal_mask_planted():
    # 7 positions, blocks of 3 aligned at 0: [0 1 2] [3 4 5] [6]
    expected = torch.tensor([[1, 1, 1, 0, 0, 0, 0]] * 3 + [[1, 1, 1, 1, 1, 1, 0]] * 3 + [[1] * 7], dtype=torch.bool)
    assert torch.equal(masks.block_causal(7, 3)[0, 0], expected)


def test_prompt_tail_shares_a_block_with_the_first_generated_tokens(tmp_path):
    # a 6-token prompt with blocks of 4: positions 4, 5 (prompt tail) and 6, 7 (generated) form one block
    folder, _, _ = write_llada2(tmp_path / "llada2")
    model = HookedMDM.from_pretrained(folder)
    tokens = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(2))
    edit_7, edit_8 = tokens.clone(), tokens.clone()
    edit_7[0, 7] = (tokens[0, 7] + 1) % 100
    edit_8[0, 8] = (tokens[0, 8] + 1) % 100
    with torch.no_grad():
        base, after_7, after_8 = (model(t, block_length=4)[0] for t in (tokens, edit_7, edit_8))
    diff_7 = (after_7 - base).abs().amax(-1)
    diff_8 = (after_8 - base).abs().amax(-1)
    assert bool((diff_7[4:8] > 1e-3).all())  # the prompt tail sees generated token 7
    # the earlier block does not (1e-5, not 0: the MoE batches other tokens per expert, so GEMM rounding moves)
    assert float(diff_7[:4].max()) <= 1e-5
    assert float(diff_8[:8].max()) <= 1e-5 and bool((diff_8[8:] > 1e-3).all())  # nor the later block's tokens
