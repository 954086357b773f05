"""The curated mutants: realistic single-point bugs (a sign, an axis, an off-by-one, a dropped factor, a
default changed, an option ignored), each a literal snippet of the source and its replacement.

Keep each `find` unique in its file; tests/test_mutants_catalogue.py fails when one goes stale."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    id: str
    area: str
    file: str
    find: str
    replace: str
    note: str
    tests: tuple[str, ...] = ()  # empty: the whole suite


def _m(id: str, area: str, file: str, find: str, replace: str, note: str) -> Mutant:
    return Mutant(id, area, file, find, replace, note)


D, M, L, H, P = "mdm_lens/diffusion/", "mdm_lens/", "mdm_lens/loading/", "mdm_lens/hooks/", "mdm_lens/probes/"

MUTANTS: list[Mutant] = [
    # --- samplers ---------------------------------------------------------------------------------------------
    _m("dream-entropy-sign", "sampler", D + "noise.py",
       "confidence = torch.sum(probs * torch.log(probs + 1e-10), dim=-1)",
       "confidence = -torch.sum(probs * torch.log(probs + 1e-10), dim=-1)", "entropy confidence with the wrong sign"),
    _m("dream-margin-order", "sampler", D + "noise.py",
       "confidence = top2[:, 0] - top2[:, 1]", "confidence = top2[:, 1] - top2[:, 0]",
       "topk_margin sorted the wrong way"),
    _m("dream-origin-inverted", "sampler", D + "dream.py",
       "p_transfer = 1 - s / t if", "p_transfer = s / t if", "origin's transfer probability inverted"),
    _m("llada-cfg-direction", "sampler", D + "llada.py",
       "logits = un_logits + (cfg_scale + 1) * (logits - un_logits)",
       "logits = un_logits + (cfg_scale + 1) * (un_logits - logits)", "classifier-free guidance reversed"),
    _m("llada-block-bound", "sampler", D + "llada.py",
       "x0_p[:, blk.stop:] = float(\"-inf\")", "x0_p[:, blk.stop + 1:] = float(\"-inf\")",
       "one position past the current block may be decoded"),
    _m("llada-gumbel-exponent", "sampler", D + "noise.py",
       "(-torch.log(u)) ** temperature", "(-torch.log(u)) ** (1 / temperature)",
       "Gumbel noise with the inverse temperature"),
    # --- model ------------------------------------------------------------------------------------------------
    _m("rmsnorm-eps-outside", "model", M + "components.py",
       "(x32.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()", "x32.pow(2).mean(-1, keepdim=True).sqrt() + self.eps",
       "RMSNorm's eps added after the square root"),
    _m("rotary-theta-exponent", "model", M + "components.py",
       "dtype=dtype) / d_head))", "dtype=dtype) / (d_head - 2)))", "rotary frequencies off by one"),
]

MUTANTS += [
    # --- model ------------------------------------------------------------------------------------------------
    _m("rotary-sign", "model", M + "components.py",
       "out[..., :half] -= x[..., half:] * sin[..., :half]", "out[..., :half] += x[..., half:] * sin[..., :half]",
       "rotate-half with the wrong sign"),
    _m("gqa-view-grouping", "model", M + "components.py",
       "return read_only(kv.repeat_interleave(self.repeat_kv_heads, dim=0),",
       "return read_only(kv.repeat(self.repeat_kv_heads, *([1] * (kv.ndim - 1))),",
       "W_K/W_V/b_K/b_V views tile kv heads instead of grouping them"),
    _m("dream-shift-direction", "model", M + "model.py",
       "return torch.cat([raw[:, :1], raw[:, :-1]], dim=1)", "return torch.cat([raw[:, 1:], raw[:, -1:]], dim=1)",
       "Dream's logit shift the wrong way"),
    _m("pair-mask-query", "model", M + "masks.py",
       "return (valid[:, None, :, None] & valid[:, None, None, :])", "return valid[:, None, None, :].expand(-1, 1, valid.shape[1], -1)",
       "Dream pair mask without the query side"),
    # --- loading ----------------------------------------------------------------------------------------------
    _m("llada-tying-default", "loading", L + "llada.py", '    "weight_tying": True,', '    "weight_tying": False,',
       "LLaDA's missing weight_tying read as untied"),
    _m("llada-rope-default", "loading", L + "llada.py", '"rope_theta": 10000.0, "include_qkv_bias"',
       '"rope_theta": 500000.0, "include_qkv_bias"', "LLaDA's missing rope_theta default"),
    _m("hf-tying-ignored", "loading", L + "hf.py",
       'tie_word_embeddings=bool(_get(config, family, "tie_word_embeddings")),', "tie_word_embeddings=False,",
       "tie_word_embeddings ignored by the HF-family loader"),
    # --- hooks and reducers -----------------------------------------------------------------------------------
    _m("phase-filter-ignored", "hooks", H + "steps.py",
       "return (phase in self.phases and self._matches_step(step, n_steps)",
       "return (True and self._matches_step(step, n_steps)", "a cond-only hook fires on the uncond pass too"),
    _m("every-drops-last", "hooks", H + "steps.py",
       "step % self.every == 0 or step == n_steps - 1", "step % self.every == 0",
       "steps(every=k) loses the always-included last step"),
    _m("received-mass-undivided", "hooks", M + "pattern_rows.py",
       "torch.where(n > 0, out / n.clamp(min=1e-300), torch.full_like(out, float(\"nan\")))",
       "torch.where(n > 0, out, torch.full_like(out, float(\"nan\")))",
       "received mass not divided by the query count"),
    _m("topk-smallest", "hooks", M + "pattern_rows.py",
       "pattern.float().topk(min(self.k, pattern.shape[-1]), dim=-1)",
       "pattern.float().topk(min(self.k, pattern.shape[-1]), dim=-1, largest=False)", "TopKKeys keeps the smallest"),
    _m("visibility-causal-count", "hooks", H + "reducers.py",
       "seen = w.flip(-1).cumsum(-1).flip(-1) if causal", "seen = w.cumsum(-1) if causal",
       "causal |Q_j| counts queries before j instead of at/after"),
    _m("memory-estimate-steps", "hooks", H + "memory.py", "    return total * n_steps", "    return total",
       "cache estimate forgets the step factor"),
    # --- probes -----------------------------------------------------------------------------------------------
    _m("harmonic-offset", "probe", P + "received.py", "torch.cumsum(1.0 / steps, 0)", "torch.cumsum(1.0 / (steps + 1), 0)",
       "causal uniform null with H_n off by one"),
    _m("causal-rank-offset", "probe", P + "received.py", "rank = torch.cumsum(vis.long(), -1) - 1",
       "rank = torch.cumsum(vis.long(), -1)", "causal null rank off by one"),
    _m("loo-count", "probe", P + "floating.py", "m = (vis.sum(-1, keepdim=True) - 1).clamp_min(1)",
       "m = vis.sum(-1, keepdim=True).clamp_min(1)", "leave-one-out mean divides by n instead of n-1"),
    _m("zscore-sign", "probe", P + "floating.py", "out = (r > mu + eps * sd) & (r >= floor * base) & (n >= 2)",
       "out = (r > mu - eps * sd) & (r >= floor * base) & (n >= 2)", "z-score threshold below the mean"),
    _m("top1-null-min", "probe", P + "floating.py", "torch.where(vis, u, torch.zeros_like(u)).amax(-1)",
       "torch.where(vis, u, torch.zeros_like(u)).amin(-1)", "top-1 null at the wrong key"),
    _m("top1-argmin", "probe", P + "floating.py", "hot.scatter_(-1, masked.argmax(-1, keepdim=True), True)",
       "hot.scatter_(-1, masked.argmin(-1, keepdim=True), True)", "top-1 anchor is the least-attended key"),
    _m("zscore-default-eps", "probe", P + "floating.py", '_DEFAULT_EPS = {"zscore": 3.0,', '_DEFAULT_EPS = {"zscore": 2.0,',
       "detector's default threshold changed"),
    _m("qk-kv-grouping", "probe", P + "qk.py", "return h % n_kv_heads if mode == \"paper\" else h // (n_heads // n_kv_heads)",
       "return h % n_kv_heads", "QK decomposition pairs query heads with the wrong kv head"),
    _m("qk-norm-term-sign", "probe", P + "qk.py",
       "n_ij = (a_star[..., None, None] - a[..., None, :]) * (b_star[..., None] + bij) / 2",
       "n_ij = (a[..., None, :] - a_star[..., None, None]) * (b_star[..., None] + bij) / 2", "norm term sign flipped"),
    _m("flow-density", "probe", P + "flow.py", "density = answer_row / (sizes / sizes.sum())",
       "density = answer_row / sizes", "density not normalised by the region share"),
    _m("flow-gold-ratio", "probe", P + "flow.py", "return row[..., gold].mean(-1) / row[..., docs].mean(-1)",
       "return row[..., gold].sum(-1) / row[..., docs].mean(-1)", "gold ratio sums instead of averaging"),
    _m("retrieval-any-window", "probe", P + "retrieval.py",
       'wanted = range(sp + 1) if method == "copy@any" else [sp]', 'wanted = range(sp) if method == "copy@any" else [sp]',
       "copy@any misses the commit step"),
    _m("rank-ties", "probe", P + "_causal.py", "above = logits > own", "above = logits >= own",
       "gold rank counts ties (and itself) as above"),
    _m("patch-direction-swap", "probe", P + "patching.py",
       'run_input, source = (x, cache_x) if direction == "noising" else (xc, cache_c)',
       'run_input, source = (xc, cache_c) if direction == "noising" else (x, cache_x)', "noising and denoising swapped"),
    # --- this session: bridge speed paths, DiffusionGemma sequence probes, chat templates, chunked absorption ----
    _m("tap-never-removed", "bridge", "mdm_lens/bridge/taps.py", "        elif not want and self._handle is not None:",
       "        elif False:", "a tap stays registered after its last hook is removed"),
    _m("fast-path-skips-wrapper-points", "bridge", "mdm_lens/bridge/layers.py",
       "return any(hp.fwd_hooks or hp.bwd_hooks for hp in self._points)", "return False",
       "a hooked block still runs transformers' layer code (wrapper hooks never fire)"),
    _m("accelerate-hooks-bypassed", "bridge", "mdm_lens/bridge/layers.py",
       'slot = "_old_forward" if hasattr(layer, "_hf_hook") and "_old_forward" in layer.__dict__ else "forward"',
       'slot = "forward"', "device_map / offload hooks skipped by the hooked layer"),
    _m("sequence-all-keys-visible", "bridge", "mdm_lens/bridge/sequence.py", "        visible[l] = seen[:, 0, 0]",
       "        visible[l] = torch.ones_like(seen[:, 0, 0])", "sliding layers' dropped prompt keys counted in the nulls"),
    _m("sequence-prompt-rows-query", "bridge", "mdm_lens/bridge/sequence.py", "    rows[:, :P] = False",
       "    rows[:, :P] = True", "prompt rows (no decoder queries) join the query set"),
    _m("topk-query-offset", "hooks", H + "reducers.py", "offset = state.rows.start if state.query_rows is not None else tops[0].query_offset\n",
       "offset = state.rows.start if state.query_rows is not None else 0 * tops[0].query_offset\n", "canvas query rows recorded at canvas-relative positions"),
    _m("chat-no-lstrip", "sweep", "mdm_lens/chat.py", "trim_blocks=True, lstrip_blocks=True",
       "trim_blocks=True, lstrip_blocks=False", "chat template rendered without transformers' whitespace rules"),
    _m("chunked-absorption-no-mask", "probe", P + "absorption.py",
       "None if am is None else am.bool(), mode, rule, per_head, layer_ids)\n\n\ndef absorption_from_attention",
       "None, mode, rule, per_head, layer_ids)\n\n\ndef absorption_from_attention",
       "chunked absorption forgets the padding (nulls over pad keys)"),
    _m("canvas-gold-offset", "probe", P + "knockout_bd.py", '        start = int(st.extra["canvas_start"])',
       '        start = int(st.extra["canvas_start"]) + 1', "DiffusionGemma gold scored one position off"),
]
