"""The replay invariant on the families added in round four: for every step k of a run, `out.replay(model, k)`
recomputes exactly the forward the sampler ran at step k (the rows it computed), or refuses with a typed error that
says why — never a different forward. Checked by hooking the run itself and the replay at the same hook point."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from mdm_lens import HookedMDM
from mdm_lens.errors import SamplerConfigError

sys.path.insert(0, str(Path(__file__).parent / "families"))
HOOK = "blocks.0.hook_resid_post"


def _load(tmp_path, family):
    if family in ("bd3lm", "gidd"):
        from bd3gidd_checkpoints import write_bd3lm, write_gidd

        folder = (write_bd3lm if family == "bd3lm" else write_gidd)(tmp_path / family, seed=1)[0]
    elif family in ("nemotron", "nemotron_ar"):
        from nemotron_fixture import write_nemotron

        folder = write_nemotron(tmp_path / family)[0]
    else:
        from rnd1_coda_checkpoints import write_coda, write_rnd1

        folder = (write_rnd1 if family == "rnd1" else write_coda)(tmp_path / family)[0]
    return HookedMDM.from_pretrained(str(folder), load_tokenizer=False)


RUNS = {
    "bd3lm": dict(prompt=[[7]], kw=dict(gen_length=15, steps=3)),
    "bd3lm_kv": dict(prompt=[[7]], kw=dict(gen_length=15, steps=3, kv_cache=True)),
    "gidd": dict(prompt=[[3, 4]], kw=dict(gen_length=10, steps=5)),
    "nemotron": dict(prompt=[[5, 6, 7, 8]], kw=dict(sampler="nemotron", gen_length=8)),
    "nemotron_ar": dict(prompt=[[5, 6, 7, 8]], kw=dict(sampler="nemotron_ar", gen_length=4)),
    "rnd1": dict(prompt=[[5, 6, 7, 8]], kw=dict(sampler="rnd1", steps=4, gen_length=8)),
    "coda": dict(prompt=[[5, 6, 7, 8]], kw=dict(sampler="coda", steps=4, gen_length=8)),
}


@pytest.mark.parametrize("case", sorted(RUNS))
def test_replay_is_the_forward_the_run_ran_or_a_typed_refusal(tmp_path, case):
    family = case.removesuffix("_kv")
    model = _load(tmp_path, family)
    seen: list[tuple[int, torch.Tensor]] = []

    def spy(x, hook):
        st = model.state
        if st is not None and st.phase == "cond":
            seen.append((st.step, int(st.extra.get("query_start", 0)), x.detach().clone()))

    spec = RUNS[case]
    out = model.generate(torch.tensor(spec["prompt"]), seed=0, fwd_hooks=[(HOOK, spy)], **spec["kw"])
    assert seen
    checked = 0
    for step in sorted({seen[0][0], seen[len(seen) // 2][0], seen[-1][0]}):
        ran = [(q0, x) for s, q0, x in seen if s == step]
        got = []
        try:
            out.replay(model, step, fwd_hooks=[(HOOK, lambda x, hook: got.append(x.detach().clone()))])
        except SamplerConfigError as e:
            assert e.argument == "out" and f"sampler={out.sampler!r}" in str(e) and "trajectory" in str(e), str(e)
            continue
        assert len(ran) == 1, f"step {step} ran {len(ran)} forwards; a replay recomputes one"
        (q0, x), = ran
        (r,) = got
        rows = r[:, q0:q0 + x.shape[1]] if r.shape[1] != x.shape[1] else r
        torch.testing.assert_close(rows, x, rtol=1e-5, atol=1e-5 * float(x.abs().max()))
        checked += 1
    # every sampler here replays its steps: the full-canvas ones, and the windowed ones (BD3LM, Nemotron) through
    # their rebuilt windows and caches (mdm_lens.diffusion.window_replay)
    assert checked == len({seen[0][0], seen[len(seen) // 2][0], seen[-1][0]})
