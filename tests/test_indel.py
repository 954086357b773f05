"""LLaDA2.2's InDel sampler (`sampler="indel"`): token-exact against the plain-torch transcription of SGLang's
JointThresholdInDel (tests/indel_reference.py) on a LLaDA2 hub-layout checkpoint whose config.json names the edit
tokens and a non-default block length; a planted run whose canvas, slot map and books are known exactly; the
hooks / cache / reducer / replay bookkeeping; and the refusals."""

from __future__ import annotations

import pytest
import torch

from mdm_lens import HookedMDM
from mdm_lens.diffusion.varlen import require_fixed_length
from mdm_lens.errors import InputError, SamplerConfigError
from mdm_lens.hooks.reducers import ReceivedAttention
from mdm_lens.hooks.trajectory import TrajectoryCache
from tests.families.family_checkpoints import MASK_ID, write_llada2
from tests.indel_reference import reference_indel_generate

DEL, SPLIT, EOS = 96, 97, 98
PROMPT = torch.tensor([[3, 11, 5, 20, 6]])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    f, _, _ = write_llada2(tmp_path_factory.mktemp("indel") / "llada2-edit", delete_token_id=DEL,
                           split_token_id=SPLIT, block_length=8)
    return f


def indel_model(folder, boost=2.0, eos_boost=1.0):
    """The checkpoint with DELETE / SPLIT (and EOS) boosted so unplanted runs insert and delete; the mask row of
    the unembedding zeroed (a trained model does not predict the mask itself)."""
    model = HookedMDM.from_pretrained(str(folder))
    with torch.no_grad():
        model.unembed.weight[[DEL, SPLIT]] *= boost
        model.unembed.weight[EOS] *= eos_boost
        model.unembed.weight[MASK_ID] = 0
    return model


def _ref(forward, prompt=PROMPT, **kw):
    return reference_indel_generate(forward, prompt, mask_id=MASK_ID, delete_id=DEL, split_id=SPLIT, eos_id=EOS,
                                    **kw)


CASES = [  # boost, eos_boost, settings
    (1.5, 1.0, dict(gen_length=10, max_post_edit_steps=3)),
    (2.0, 1.0, dict(gen_length=10, max_post_edit_steps=3)),  # many deletions, splits and truncations
    (2.0, 1.0, dict(gen_length=10, threshold=0.1, edit_threshold=0.3, max_post_edit_steps=2)),
    (2.0, 1.0, dict(gen_length=10, block_length=4, max_post_edit_steps=0)),
    (1.0, 2.5, dict(gen_length=14, block_length=4, max_post_edit_steps=1)),  # EOS: stops after a block
]


@pytest.mark.parametrize("boost, eos_boost, kw", CASES)
def test_indel_matches_the_reference_token_for_token(folder, boost, eos_boost, kw):
    model = indel_model(folder, boost, eos_boost)
    out = model.generate(PROMPT, sampler="indel", **kw)
    bl = out.settings["block_length"]
    assert bl == kw.get("block_length", 8)  # 8: the checkpoint's config.json, not the default 32
    ref, n_forwards = _ref(lambda x, pos, b: model(x, position_ids=pos, block_length=b), **dict(kw, block_length=bl))
    assert torch.equal(out.tokens, ref) and out.n_steps == n_forwards
    gen = ref[0, PROMPT.shape[1]:PROMPT.shape[1] + kw["gen_length"]]
    eos = (gen == EOS).nonzero()
    assert out.answer_length == [int(eos[0, 0]) + 1 if len(eos) else kw["gen_length"]]


def test_the_exact_cases_exercise_deletion_insertion_truncation_and_eos(folder, monkeypatch):
    import mdm_lens.diffusion.indel as indel

    hows, inserted, stopped, calls = [], 0, False, {"anti_loop": 0, "scrubbed_rows": 0}
    plain = indel._without

    def counting(logits, x, rows, banned):  # rows None: the anti-loop resample; else the post-edit scrub
        if rows is None:
            calls["anti_loop"] += 1
        else:
            calls["scrubbed_rows"] += int(rows.sum())
        return plain(logits, x, rows, banned)

    monkeypatch.setattr(indel, "_without", counting)
    for boost, eos_boost, kw in CASES:
        out = indel_model(folder, boost, eos_boost).generate(PROMPT, sampler="indel", **kw)
        L = out.trajectory.length
        hows.append(L.removed_how.flatten())
        inserted += L.n_slots - L.n_original
        stopped |= bool((out.tokens[0, PROMPT.shape[1]:] == MASK_ID).any()) and out.answer_length[0] < kw["gen_length"]
    how = torch.cat(hows)
    assert int((how == 1).sum()) >= 10 and int((how == 3).sum()) >= 5 and inserted >= 20 and stopped
    assert calls["anti_loop"] >= 3 and calls["scrubbed_rows"] >= 10  # both rare branches are in the exact cases


def _planted(model, plan):
    """A hook on ln_final's output that sets every row of the block being decoded: planted rows get the
    direction of their token (p ≈ 1), decoded rows their current token (no edit), other rows zero (uniform
    logits, p = 1/vocab: below every threshold used). `plan[step] = {column: token}`. Reads (step, x, block)
    from `where()`."""
    def direction(token):
        return 400 * model.unembed.weight[token] / model.ln_final.w

    def make(where):
        def hook(resid, hook):
            step, x, lo = where()
            resid = torch.zeros_like(resid)
            for c in range(lo, resid.shape[1]):
                token = plan.get(step, {}).get(c, None if int(x[0, c]) == MASK_ID else int(x[0, c]))
                if token is not None:
                    resid[0, c] = direction(token)
            return resid
        return hook
    return make


# prompt 3 + gen 5 = one block of 8: masks at columns 3..7 (slots 3..7). Step 0: 40 at 3, SPLIT at 5 (slot 7
# truncated). Step 1: SPLIT on the decoded 40 (T2T), 41 at 4, DELETE at the mask of column 6. Step 2: the three
# masks left. Step 3 (post-edit 1): DELETE on 41 (a new mask is padded). Step 4: post-edit budget spent: the
# last mask is filled and the block ends.
PLAN = {0: {3: 40, 5: SPLIT}, 1: {3: SPLIT, 4: 41, 6: DEL}, 2: {3: 42, 6: 43, 7: 44}, 3: {5: DEL}, 4: {7: 45}}
PLANT_KW = dict(gen_length=5, threshold=0.5, edit_threshold=0.5, max_post_edit_steps=1)


def test_planted_insertions_and_deletions_move_the_canvas_exactly(folder):
    model = indel_model(folder, 1.0)
    make = _planted(model, PLAN)
    hook = make(lambda: (model.state.step, model.state.x, model.state.block_slice.start))
    prompt = PROMPT[:, :3]
    out = model.generate(prompt, sampler="indel", fwd_hooks=[("ln_final.hook_normalized", hook)], **PLANT_KW)
    assert out.tokens[0].tolist() == [3, 11, 5, 42, 40, 43, 44, 45] and out.n_steps == 5
    L = out.trajectory.length
    assert L.slot_steps[:, 0, 3:].tolist() == [[3, 4, 5, 6, 7], [3, 4, 8, 5, 6], [9, 3, 4, 8, 6], [9, 3, 4, 8, 6],
                                              [9, 3, 8, 6, 10]]
    assert L.final_slot[0].tolist() == [0, 1, 2, 9, 3, 8, 6, 10]
    assert L.origin_steps[2, 0].tolist() == [0, 1, 2, -1, 3, 4, -1, 6]
    assert L.commit_step[0].tolist() == [-1, -1, -1, 0, 1, -2, 2, -2, 2, 2, 4]
    assert L.commit_token[0, [3, 4, 6, 8, 9, 10]].tolist() == [40, 41, 44, 43, 42, 45]
    assert (L.removed_step[0].tolist(), L.removed_how[0].tolist()) == (
        [-1, -1, -1, -1, 3, 1, -1, 0, -1, -1, -1], [0, 0, 0, 0, 1, 1, 0, 3, 0, 0, 0])
    # every slot that was masked and is still on the canvas was committed exactly once, to its final token
    final = L.final_slot[0, 3:]
    assert L.n_commits[0, final].tolist() == [1] * 5
    assert torch.equal(L.commit_token[0, final], out.tokens[0, 3:])
    assert out.trajectory.commit_step[0].tolist() == [-1, -1, -1, 2, 0, 2, 2, 4]
    assert L.widths.tolist() == [8] * 5  # constant width: the rows move, the canvas does not grow
    # the reference, planted the same way, agrees token for token
    seen = {"step": -1}

    def forward(x, pos, b):
        seen["step"] += 1
        seen["x"] = x
        return model.run_with_hooks(x, position_ids=pos, block_length=b,
                                    fwd_hooks=[("ln_final.hook_normalized", ref_hook)])
    ref_hook = make(lambda: (seen["step"], seen["x"], 0))
    ref, n = _ref(forward, prompt, **dict(PLANT_KW, block_length=8))
    assert torch.equal(out.tokens, ref) and n == 5


def test_step_extras_name_the_edits_in_the_steps_coordinates(folder):
    model = indel_model(folder, 1.0)
    hook = _planted(model, PLAN)(lambda: (model.state.step, model.state.x, model.state.block_slice.start))
    got = {}

    class Spy(ReceivedAttention):
        def end_step(self, state):
            got[state.step] = {k: state.extra[k][0].nonzero().flatten().tolist() for k in ("edited", "deleted",
                                                                                           "split")}
            got[state.step]["committed"] = state.committed[0].nonzero().flatten().tolist()
            super().end_step(state)

    model.generate(PROMPT[:, :3], sampler="indel", fwd_hooks=[("ln_final.hook_normalized", hook)], record=[Spy()],
                   **PLANT_KW)
    assert got[0] == dict(edited=[], deleted=[], split=[5], committed=[3])
    assert got[1] == dict(edited=[3], deleted=[6], split=[3], committed=[4])
    assert got[3] == dict(edited=[5], deleted=[5], split=[], committed=[])
    assert got[4]["committed"] == [7]


def test_hooks_cache_records_and_replay_follow_the_slots(folder):
    model = indel_model(folder, 2.0)
    seen, kept = {}, {}

    def spy(t, hook):
        seen[model.state.step] = model.state.origin.clone()
        kept[model.state.step] = t.clone()

    cache = TrajectoryCache("blocks.0.hook_resid_post")
    out = model.generate(PROMPT, sampler="indel", gen_length=10, max_post_edit_steps=3, record=[ReceivedAttention()],
                         cache=cache, fwd_hooks=[("blocks.2.hook_resid_post", spy)])
    L = out.trajectory.length
    assert int((L.removed_how > 0).sum()) > 0
    for s, origin in seen.items():
        assert torch.equal(origin, L.origin_steps[s]) and torch.equal(cache.origin_of(s), origin)
    meta = out.record_meta["received_attention"]["origin"]
    assert torch.equal(meta[:, 0], L.origin_steps[:, 0])
    for s in (0, out.n_steps // 2, out.n_steps - 1):
        again = {}
        out.replay(model, s, fwd_hooks=[("blocks.2.hook_resid_post", lambda t, hook: again.setdefault(s, t))])
        assert torch.allclose(again[s], kept[s], atol=1e-5, rtol=1e-5)
        assert torch.equal(out.state_at(s).origin, L.origin_steps[s])
    with pytest.raises(SamplerConfigError, match="did not exist at a step"):
        require_fixed_length(out, "probe X")


@pytest.mark.parametrize("kw, error, match", [
    (dict(prompt=torch.tensor([[3, DEL, 5]])), InputError, "DELETE token 96"),
    (dict(prompt=torch.tensor([[3, SPLIT, 5]])), InputError, "SPLIT token 97"),
    (dict(prompt=torch.cat([PROMPT, PROMPT])), SamplerConfigError, "one unpadded prompt"),
    (dict(threshold=1.5), SamplerConfigError, "threshold"),
    (dict(max_post_edit_steps=-1), SamplerConfigError, "max_post_edit_steps"),
    (dict(steps=4), SamplerConfigError, "unknown setting steps"),
])
def test_refusals_name_the_argument(folder, kw, error, match):
    model = indel_model(folder)
    args = dict(prompt=PROMPT, gen_length=4)
    args.update(kw)
    with pytest.raises(error, match=match):
        model.generate(args.pop("prompt"), sampler="indel", **args)


def test_a_checkpoint_without_edit_tokens_is_refused(tmp_path):
    plain, _, _ = write_llada2(tmp_path / "plain")
    model = HookedMDM.from_pretrained(str(plain))
    with pytest.raises(SamplerConfigError, match="delete_token_id=None, split_token_id=None") as info:
        model.generate(PROMPT, sampler="indel", gen_length=4)
    assert info.value.argument == "delete_token_id"
