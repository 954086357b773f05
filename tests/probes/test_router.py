"""The router probe on a tiny LLaDA-MoE checkpoint: entropies and loads against direct recomputation, the class
loads add up, the anchor-vs-rest distance on planted routings, typed errors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "families"))
from family_checkpoints import write_lladamoe  # noqa: E402

from mdm_lens import HookedMDM, InputError, MDMConfig  # noqa: E402
from mdm_lens.errors import ArgumentError  # noqa: E402
from mdm_lens.probes import router_stats  # noqa: E402


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    model = HookedMDM.from_pretrained(write_lladamoe(tmp_path_factory.mktemp("moe") / "m")[0])
    prompt = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(1))
    out = model.generate(prompt, gen_length=4, steps=4, sampler="llada")
    return model, out


def test_entropy_and_loads_equal_a_direct_recomputation(moe):
    model, out = moe
    stats = router_stats(model, out, steps=[1])
    t = stats.table
    layers = sorted(set(t["layer"].dropna().astype(int)))
    assert layers and all(hasattr(model.blocks[l].mlp, "hook_router_logits") for l in layers)
    x = out.trajectory.x_steps[1]
    names = [f"blocks.{l}.mlp.{h}" for l in layers for h in ("hook_router_logits", "hook_expert_indices")]
    _, cache = model.run_with_cache(x, names_filter=lambda n: n in names)
    for l in layers:
        p = torch.softmax(cache[f"blocks.{l}.mlp.hook_router_logits"].double(), -1)
        h = -(p * p.log()).sum(-1).mean()
        row = t[(t["layer"] == l) & (t["metric"] == "router_entropy")]
        assert row["value"].item() == pytest.approx(float(h), abs=1e-6)  # replay runs the explicit attention path
        idx = cache[f"blocks.{l}.mlp.hook_expert_indices"]
        counts = torch.bincount(idx[:, :5].flatten(), minlength=p.shape[-1]).double()
        prompt = stats.loads(1, l).loc["prompt"].to_numpy()
        assert prompt == pytest.approx((counts / counts.sum()).numpy(), abs=1e-12)
        # the anchor and non-anchor slots together are the visible ones, as are prompt + canvas
        sizes = t[(t["layer"] == l) & (t["metric"] == "positions")].set_index("class")["value"]
        loads = stats.loads(1, l).fillna(0.0)
        slots = {c: loads.loc[c].to_numpy() * sizes[c] for c in loads.index}
        assert slots["anchor"] + slots["non_anchor"] == pytest.approx(slots["prompt"] + slots["canvas"], abs=1e-9)
        assert sizes["prompt"] + sizes["canvas"] == 2 * 9 and sizes["prompt"] == 2 * 5


def test_the_anchor_distance_on_planted_routings(moe):
    """Every query attends to key 0 (so key 0 is the layer's one anchor); position 0 is routed to expert 1 and the
    rest to expert 0: the anchor and the rest share no expert (TV 1); all to expert 0: identical routing (TV 0)."""
    model, out = moe
    first = next(l for l, b in enumerate(model.blocks) if hasattr(b.mlp, "hook_router_logits"))

    def sink_at_zero(pattern, hook):
        planted = torch.zeros_like(pattern)
        planted[..., 0] = 1.0
        return planted

    def route(split):
        def hook(idx, hook):
            new = torch.zeros_like(idx)
            if split:
                new[:, 0] = 1
            return new
        return hook

    for split, expected in ((True, 1.0), (False, 0.0)):
        hooks = [(f"blocks.{first}.attn.hook_pattern", sink_at_zero),
                 (f"blocks.{first}.mlp.hook_expert_indices", route(split))]
        t = router_stats(model, out, steps=[0], layers=[first], fwd_hooks=hooks).table
        sizes = t[t["metric"] == "positions"].set_index("class")["value"]
        assert sizes["anchor"] == 2  # key 0 of each row
        tv = t[t["metric"] == "anchor_vs_rest_tv"].iloc[0]
        assert tv["value"] == expected and tv["reason"] == ""
    t = router_stats(model, out, steps=[0], layers=[first]).table
    tv = t[t["metric"] == "anchor_vs_rest_tv"].iloc[0]
    if t[(t["metric"] == "positions") & (t["class"] == "anchor")]["value"].item() == 0:
        assert tv["value"] != tv["value"] and tv["reason"] == "no anchor at this step and layer"


def test_a_dense_model_and_dense_layers_are_refused(moe):
    model, out = moe
    dense = HookedMDM.from_config(MDMConfig(d_model=16, n_layers=1, n_heads=2, d_mlp=16, d_vocab=20,
                                            mask_token_id=19, n_ctx=20), seed=0)
    with pytest.raises(InputError, match="no mixture-of-experts"):
        router_stats(dense, dense.generate(torch.tensor([[3, 4]]), gen_length=2))
    dense_layers = [l for l, b in enumerate(model.blocks) if not hasattr(b.mlp, "hook_router_logits")]
    if dense_layers:
        with pytest.raises(InputError, match="dense"):
            router_stats(model, out, layers=dense_layers[:1])
    with pytest.raises(ArgumentError, match="steps"):
        router_stats(model, out, steps=[99])
