"""Answer emergence: planted cases of the vectorised core, and the full table against a brute-force recomputation
from the cached residuals (its own argmax, its own loops)."""

import pytest
import torch

from mdm_lens.errors import ArgumentError, ArgumentTypeError
from mdm_lens.lens import answer_emergence, emergence_steps, lens_trace

from ._lensfix import dream_model, run, twin_prompts


def test_planted_emergence_steps():
    # one layer, one row, four positions over steps 0..4; horizons (last counted step) 4, 4, 2, 4
    c = torch.tensor([[1, 0, 1, 1],   # step 0
                      [1, 1, 1, 0],   # step 1
                      [1, 0, 1, 1],   # step 2
                      [1, 1, 0, 1],   # step 3
                      [1, 1, 0, 0]],  # step 4
                     dtype=torch.bool)[:, None, None]
    end = torch.tensor([[4, 4, 2, 4]])
    first = emergence_steps(c, [0, 1, 2, 3, 4], end)
    # pos 0: always right -> 0; pos 1: right from 3 on -> 3; pos 2: horizon 2, right at 0..2 -> 0 (step 3's miss is
    # after the horizon); pos 3: wrong at the horizon -> -1
    assert first.tolist() == [[[0, 3, 0, -1]]]
    # a coarse grid: steps 0, 2, 4 only (rows 0, 2, 4 of the planted table)
    grid = emergence_steps(c[[0, 2, 4]], [0, 2, 4], end)
    assert grid.tolist() == [[[0, 4, 0, -1]]]


def test_planted_emergence_skips_cells_the_lens_did_not_compute():
    # a windowed run: pos 0 is computed at steps 1-2 only, pos 1 at steps 0, 1 and 3; uncomputed cells (their
    # `correct` planted False, as a -1 top-1 would give) neither count nor break the run
    c = torch.tensor([[0, 1], [1, 0], [1, 0], [0, 1]], dtype=torch.bool)[:, None, None]
    computed = torch.tensor([[0, 1], [1, 1], [1, 0], [0, 1]], dtype=torch.bool)[:, None, None]
    end = torch.tensor([[3, 3]])
    assert emergence_steps(c, [0, 1, 2, 3], end, computed).tolist() == [[[1, 3]]]
    assert emergence_steps(c, [0, 1, 2, 3], end).tolist() == [[[-1, 3]]]  # without the mask step 3 breaks pos 0


def test_a_windowed_trace_says_a_position_was_not_computed(tmp_path):
    # Nemotron: a block's first token is committed by a causal forward the lens does not read (NaN there)
    from mdm_lens import HookedMDM
    from tests.families.nemotron_fixture import write_nemotron

    model = HookedMDM.from_pretrained(str(write_nemotron(tmp_path / "n")[0]), load_tokenizer=False)
    out = model.generate(torch.tensor([[7, 9, 11, 3, 5]]), gen_length=8, sampler="nemotron", seed=0,
                         cache=["blocks.*.hook_resid_post"])
    trace = lens_trace(model, out)
    table = answer_emergence(trace)
    seeds = table[table["commit_step"].isin([0, 4])]  # the prefill and the first commit forward seed positions
    assert len(seeds) > 0 and seeds["note"].str.contains("did not compute this position").all()
    assert not table["note"].fillna("").str.contains("top-1 is not the final token at step 0").any()
    denoised = table[~table["commit_step"].isin([0, 4])]
    assert denoised["emergence_step"].notna().any()


def brute_force(model, out, horizon):
    """{(batch, layer, position): emergence step or None}, from the residuals, one cell at a time."""
    P, n_layers = out.prompt_length, model.cfg.n_layers
    gen = out.tokens.shape[1] - P
    shift = 1 if model.cfg.logit_shift else 0
    top = {}
    for s in range(out.n_steps):
        for l in range(n_layers):
            resid = out.cache[s][f"blocks.{l}.hook_resid_post"]
            logits = model.unembed(model.ln_final(resid))
            for b in range(out.tokens.shape[0]):
                for p in range(gen):
                    top[s, l, b, p] = int(logits[b, P + p - shift].argmax())
    result = {}
    for b in range(out.tokens.shape[0]):
        for p in range(gen):
            final = int(out.tokens[b, P + p])
            commit = int(out.trajectory.commit_step[b, P + p])
            last = commit if horizon == "commit" and commit >= 0 else out.n_steps - 1
            for l in range(n_layers):
                found = None
                for s in range(last + 1):
                    if all(top[t, l, b, p] == final for t in range(s, last + 1)):
                        found = s
                        break
                result[b, l, p] = found
    return result


@pytest.fixture(scope="module")
def runs(mdm):
    dream = dream_model()
    return {"twin": (mdm, run(mdm, *twin_prompts(mdm))),
            "dream": (dream, run(dream, torch.tensor([[1, 5, 6, 7], [1, 9, 10, 11]])))}


@pytest.mark.parametrize("horizon", ["commit", "end"])
@pytest.mark.parametrize("which", ["twin", "dream"])
def test_emergence_matches_brute_force(which, horizon, runs):
    model, out = runs[which]
    table = answer_emergence(lens_trace(model, out), horizon=horizon)
    expected = brute_force(model, out, horizon)
    assert len(table) == len(expected)
    got = {(int(r.batch), int(r.layer), int(r.position)): (None if r.emergence_step is None or
                                                            str(r.emergence_step) == "<NA>" else int(r.emergence_step))
           for r in table.astype(object).itertuples()}
    assert got == expected
    assert str(table.emergence_step.dtype) == "Int64" and str(table.lead.dtype) == "Int64"
    known = table.dropna(subset=["emergence_step"])
    assert (known.lead == known.commit_step - known.emergence_step).all()
    assert table.note.isna().equals(table.emergence_step.notna())       # a reason exactly where NA
    if horizon == "commit":
        assert (known.lead >= 0).all()
    # there is something to compare: some cells emerge and (layer 0 of a small model) some do not
    assert 0 < len(known) < len(table)


def test_bad_emergence_arguments(runs):
    with pytest.raises(ArgumentTypeError):
        answer_emergence("trace")
    model, out = runs["twin"]
    with pytest.raises(ArgumentError) as e:
        answer_emergence(lens_trace(model, out, layers=[3]), horizon="decode")
    assert e.value.argument == "horizon"
