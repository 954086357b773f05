"""Gradients, TransformerLens style, on every family: `run_with_cache(..., incl_bwd=True)` and
`run_with_hooks(..., bwd_hooks=...)`; the SDPA fast path and the explicit path (taken when the pattern is hooked)
give the same gradients; MoE dispatch keeps gradients to the router and to exactly the experts used; gradients at
one denoising step (`out.replay(model, k, grad=True)`, `out.at_step(model, k)`) equal those of a hand-built
forward on step k's canvas with its mask."""

from __future__ import annotations

import warnings

import pytest
import torch

from loss_family_models import FAMILIES, family_getter
from mdm_lens.diffusion.state import DenoisingState

B, T = 2, 12
BLOCK = {"llada2": 4}  # LLaDA2's default block (32) would span the whole canvas: exercise its block mask too


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    return family_getter(tmp_path_factory.mktemp("grad_families"), seed=5)


def canvas(model, seed=0):
    c = model.cfg
    ids = torch.tensor([i for i in range(c.d_vocab) if i not in (c.mask_token_id, c.pad_token_id)])
    clean = ids[torch.randint(0, len(ids), (B, T), generator=torch.Generator().manual_seed(seed))]
    x = clean.clone()
    x[:, [2, 5, 6, 10]] = c.mask_token_id
    return x, clean


def no_hooks_left(model) -> bool:
    return all(not hp.fwd_hooks and not hp.bwd_hooks for hp in model.hook_dict.values())


def close(a, b, tol=1e-5):
    """|a - b| ≤ tol relative to the scale of b (fp32 kernels differ in summation order)."""
    return float((a - b).abs().max()) <= tol * max(float(b.abs().max()), 1e-12)


def loss_grads(model, x, clean, names, **kw):
    """(d loss / d activations named, d loss / d parameters) through TL's run_with_cache(incl_bwd=True)."""
    model.zero_grad(set_to_none=True)
    loss, cache = model.run_with_cache(x, return_type="loss", targets=clean, incl_bwd=True, names_filter=names, **kw)
    params = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss, cache, params


@pytest.mark.parametrize("name", FAMILIES + ("mdm", "arm"))
def test_sdpa_and_explicit_paths_give_the_same_gradients(fam, request, name):
    model = request.getfixturevalue(name) if name in ("mdm", "arm") else fam(name)  # + the trained twins
    x, clean = canvas(model, seed=1)
    kw = {"block_length": BLOCK[name]} if name in BLOCK else {}
    resid = [f"blocks.{layer}.hook_resid_pre" for layer in range(model.cfg.n_layers)]
    patterns = [f"blocks.{layer}.attn.hook_pattern" for layer in range(model.cfg.n_layers)]
    fast_loss, fast, fast_params = loss_grads(model, x, clean, resid, **kw)
    slow_loss, slow, slow_params = loss_grads(model, x, clean, resid + patterns, **kw)  # caching the pattern hooks it
    assert no_hooks_left(model)
    assert f"{patterns[0]}_grad" in slow.keys() and f"{patterns[0]}_grad" not in fast.keys()
    assert abs(fast_loss.item() - slow_loss.item()) <= 1e-5 * fast_loss.item()
    for n in resid:
        g = fast[n + "_grad"]
        assert g.shape == (B, T, model.cfg.d_model) and float(g.abs().max()) > 0
        assert close(g, slow[n + "_grad"]), n
    assert fast_params.keys() == slow_params.keys()
    unreached = {n for n, _ in model.named_parameters()} - fast_params.keys()
    assert all(".mlp.experts." in n for n in unreached)  # only routed experts no token picked get no gradient
    for n, g in fast_params.items():
        assert close(g, slow_params[n]), n


@pytest.mark.parametrize("name", ["llada", "dream", "sdar"])
def test_padded_batches_give_the_same_gradients_on_both_paths(fam, name):
    """Padding (key mask; Dream's pair mask hides pad queries too) on the SDPA and explicit paths."""
    model = fam(name)
    x, clean = canvas(model, seed=2)
    am = torch.ones(B, T, dtype=torch.long)
    am[1, :3] = 0  # left padding
    pad = model.cfg.pad_token_id if model.cfg.pad_token_id is not None else 0
    x, clean = x.masked_fill(am == 0, pad), clean.masked_fill(am == 0, pad)
    names = ["blocks.0.hook_resid_pre"]
    _, fast, fast_params = loss_grads(model, x, clean, names, attention_mask=am)
    _, slow, slow_params = loss_grads(model, x, clean, names + ["blocks.0.attn.hook_pattern"], attention_mask=am)
    g = fast["blocks.0.hook_resid_pre_grad"]
    assert torch.isfinite(g).all() and close(g, slow["blocks.0.hook_resid_pre_grad"])
    assert float(g[1, :3].abs().max()) == 0.0  # a pad is no key and its own logits are not scored: no gradient
    for n, grad in fast_params.items():
        assert torch.isfinite(grad).all() and close(grad, slow_params[n]), n


@pytest.mark.parametrize("name", ["llada", "dream", "llada2", "sdar_moe"])
def test_cached_gradients_are_autograd_gradients(fam, name):
    """TL's `..._grad` cache entries (through CheckedHookSurface) equal `.grad` of the activation itself."""
    model = fam(name)
    x, clean = canvas(model, seed=3)
    names = ["blocks.0.hook_resid_pre", "blocks.1.attn.hook_z", "blocks.1.hook_mlp_out", "ln_final.hook_normalized"]
    _, cache, _ = loss_grads(model, x, clean, names)
    kept = {}

    def keep(t, hook):
        t.retain_grad()
        kept[hook.name] = t

    loss = model.run_with_hooks(x, return_type="loss", targets=clean, fwd_hooks=[(n, keep) for n in names])
    loss.backward()
    model.zero_grad(set_to_none=True)
    for n in names:
        assert cache[n + "_grad"].shape == kept[n].shape
        assert close(cache[n + "_grad"], kept[n].grad), n
    assert no_hooks_left(model)


@pytest.mark.parametrize("name", FAMILIES)
def test_bwd_hooks_fire_with_the_activation_shapes_and_are_removed(fam, name):
    model = fam(name)
    x, clean = canvas(model, seed=4)
    c = model.cfg
    shapes = {"blocks.0.hook_resid_post": (B, T, c.d_model), "blocks.1.attn.hook_pattern": (B, c.n_heads, T, T),
              "blocks.1.attn.hook_v": (B, T, c.n_key_value_heads, c.d_head), "hook_embed": (B, T, c.d_model)}
    seen = {}

    def spy(grad, hook):
        seen[hook.name] = grad.clone()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TL's note that bwd hooks outlive the call only with reset_hooks_end=False
        loss = model.run_with_hooks(x, return_type="loss", targets=clean, reset_hooks_end=False,
                                    bwd_hooks=[(n, spy) for n in shapes])
    try:
        loss.backward()
    finally:
        model.reset_hooks()
        model.zero_grad(set_to_none=True)
    assert no_hooks_left(model)
    assert {n: tuple(g.shape) for n, g in seen.items()} == shapes
    _, cache, _ = loss_grads(model, x, clean, list(shapes))
    for n in shapes:
        assert close(seen[n], cache[n + "_grad"]), n
    # a pattern row is a softmax: the gradient flowing into it sums to anything, but masked keys get none
    bl = c.extra.get("block_length")
    if bl and bl < T:
        g = seen["blocks.1.attn.hook_pattern"]
        assert float(g[:, :, 0, bl:].abs().max()) == 0.0  # block 0 never sees later blocks


@pytest.mark.parametrize("name", ["llada2", "lladamoe", "sdar_moe"])
def test_moe_gradients_reach_the_router_and_exactly_the_experts_used(fam, name):
    model = fam(name)
    x, clean = canvas(model, seed=6)
    layer = next(i for i, b in enumerate(model.blocks) if getattr(b, "is_moe", False))
    mlp = model.blocks[layer].mlp
    _, cache, params = loss_grads(model, x, clean, [f"blocks.{layer}.mlp.hook_expert_indices"])
    index = cache[f"blocks.{layer}.mlp.hook_expert_indices"]
    used = set(index.flatten().tolist())
    # an expert picked at a scored (masked) position reaches the loss; one picked only at other positions may
    # not (in the last layer a position's MLP output reaches only its own logits); one never picked gets nothing
    at_scored = set(index[x == model.cfg.mask_token_id].flatten().tolist())
    assert at_scored and len(used) < mlp.n_experts, "the planted routing must leave an expert unused"
    prefix = f"blocks.{layer}.mlp."
    assert float(params[prefix + "router_weight"].abs().max()) > 0  # the weights carry the router's gradient
    for e in range(mlp.n_experts):
        grads = [params.get(n) for n, _ in mlp.experts[e].named_parameters(prefix=f"{prefix}experts.{e}")]
        if e in at_scored:
            assert all(g is not None and float(g.abs().max()) > 0 for g in grads), e
        elif e not in used:
            assert all(g is None or float(g.abs().max()) == 0 for g in grads), e
    if mlp.shared_expert is not None:
        assert all(float(g.abs().max()) > 0 for n, g in params.items() if n.startswith(prefix + "shared_expert."))


# --- one denoising step ---------------------------------------------------------------------------------------------
RUNS = {
    "llada": dict(gen_length=8, steps=4, block_length=4),
    "dream": dict(gen_length=8, steps=4),
    "llada2": dict(sampler="llada2", gen_length=8, steps=4, block_length=4),
    "sdar": dict(sampler="sdar", gen_length=8, block_length=4),
}


def hand_step(out, model, k):
    """Step k's forward input built from the trajectory alone (not through replay's code)."""
    if out.sampler in ("llada2", "sdar"):
        f = out.trajectory.forwards[k]
        end = int(f["extra"]["query_end"])
        return f["x"][:, :end], {"block_length": out.settings["block_length"]}
    x = out.trajectory.x_steps[k]
    return x, {"attention_mask": out.attention_mask}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_gradients_at_one_step_equal_a_hand_built_forward(fam, name):
    model = fam(name)
    prompt = canvas(model, seed=7)[1][:1, :5]
    out = model.generate(prompt, **RUNS[name])
    k = 1
    x, kw = hand_step(out, model, k)
    targets = out.tokens[:, :x.shape[1]]
    assert bool((x == model.cfg.mask_token_id).any())
    names = ["blocks.0.hook_resid_pre"]
    want_loss, want, want_params = loss_grads(model, x, targets, names, **kw)
    # 1. replay(grad=True): the logits the sampler read, now differentiable
    model.zero_grad(set_to_none=True)
    logits = out.replay(model, k, grad=True)
    assert logits.requires_grad and model.state is None
    masked = x == model.cfg.mask_token_id
    loss = torch.nn.functional.cross_entropy(logits[masked], targets[masked])
    assert abs(loss.item() - want_loss.item()) <= 1e-5 * want_loss.item()
    loss.backward()
    for n, p in model.named_parameters():
        assert (p.grad is None) == (n not in want_params), n  # MoE: the same experts unreached
        assert p.grad is None or close(p.grad, want_params[n]), n
    model.zero_grad(set_to_none=True)
    # 2. at_step: TL's own run_with_cache(incl_bwd=True) inside step k's state
    seen = []
    with out.at_step(model, k) as (x_step, kw_step):
        assert isinstance(model.state, DenoisingState) and model.state.step == k
        assert torch.equal(x_step, x)
        seen.append(model.state)
        got_loss, got, got_params = loss_grads(model, x_step, targets, names, **kw_step)
    assert model.state is None and no_hooks_left(model)
    assert abs(got_loss.item() - want_loss.item()) <= 1e-5 * want_loss.item()
    assert close(got["blocks.0.hook_resid_pre_grad"], want["blocks.0.hook_resid_pre_grad"])
    assert got_params.keys() == want_params.keys()
    for n, g in got_params.items():
        assert close(g, want_params[n]), n


def test_at_step_restores_the_state_when_the_body_raises(fam):
    model = fam("llada")
    out = model.generate(canvas(model)[1][:1, :4], gen_length=4, steps=2)
    with pytest.raises(RuntimeError, match="boom"):
        with out.at_step(model, 0):
            raise RuntimeError("boom")
    assert model.state is None


def test_replay_without_grad_builds_no_graph(fam):
    model = fam("dream")
    out = model.generate(canvas(model)[1][:1, :4], gen_length=4, steps=2)
    assert not out.replay(model, 0).requires_grad
    with pytest.raises(Exception, match="grad"):
        out.replay(model, 0, grad="yes")
