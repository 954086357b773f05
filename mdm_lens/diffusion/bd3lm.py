"""BD3LM's semi-autoregressive block sampler (`Diffusion._semi_ar_sampler` + `_ddpm_caching_update` +
`_nucleus_sample`, kuleshov-group/bd3lms @ 1c3e8f43; families-2.md §3.6), step by step and observable.

Blocks of `block_size` positions are aligned to position 0 of the canvas (prompt + `gen_length` masks; with
`kv_cache` the total must be a multiple of block_size, without it a last block may be shorter: an extension). The reference's canvas is BOS + masks: pass the BOS id as the prompt. Per block:
t starts at 1; each step draws t *= u^(1/masked) (first hitting, u from numpy) or takes linspace(1, 0, steps)[i],
computes p(x0) of the block's rows (SUBS, float64, nucleus `nucleus_p`: sorted cumulative mass ≤ p kept, the top-1
always), draws a Gumbel-max token for every row (float64 uniforms) and, with first hitting, commits it at one
uniformly chosen masked row (`randint`); p(x0) is reused while nothing changes. With `kv_cache`, the forward sees
only the block and the cached keys of the finished blocks; a finished block is stored with one more forward (its
own step, `state.extra["kv_store"]`). Three random streams, as the reference seeded by `torch.manual_seed(seed)` +
`np.random.seed(seed)`: numpy `RandomState(seed)`, the CPU torch generator (`randint`), and the uniforms' generator
(the same CPU generator on CPU; a device generator seeded `seed` on an accelerator).

Each step keeps what its forward was (`out.trajectory.forwards[k]`: rows, keys, t, σ, cache use; a step that reused
p(x0) names its source) so that `out.replay(model, k)` rebuilds it exactly (`mdm_lens.diffusion.window_replay`).

Not reproduced: the low-entropy stop-and-retry over the last 256 tokens (the reference discards such samples),
`var_length`, and the bf16 cache of the reference on CUDA (ours is in the model dtype)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from mdm_lens import validate
from mdm_lens.ddit.outputs import subs
from mdm_lens.diffusion import rules as R
from mdm_lens.diffusion.canvas import CanvasSettings, Plan
from mdm_lens.diffusion.ddit import DDiTSampler, _full_mask, commit, warn_masked_answer
from mdm_lens.diffusion.output import TrajectoryRecorder
from mdm_lens.diffusion.registry import register, resolved
from mdm_lens.diffusion.state import DenoisingState
from mdm_lens.errors import InputError, SamplerConfigError

SIGMA_MAX = -math.log1p(-(1 - 1e-3))  # LogLinearNoise(eps=1e-3).sigma_max: only feeds the (zeroed) conditioning


@dataclass
class BD3LMSettings(CanvasSettings):
    """`steps`: steps per block (`algo.T`; the gen-PPL script: 5000), `first_hitting` True, `nucleus_p` 1.0 (script:
    0.9), `kv_cache` False (script: True), `context_size` (default model_length: the window of the recomputing
    forward; refused with `kv_cache=True`, whose cache, as the reference's, always spans model_length)."""

    steps: int | None = 5000
    first_hitting: bool = True
    nucleus_p: float = 1.0
    kv_cache: bool = False
    context_size: int | None = None
    block_size: int | None = resolved()  # the checkpoint's: the plan counts blocks before a prompt is seen

    def resolve(self, model: Any) -> "BD3LMSettings":
        n = model.cfg.n_ctx
        ctx = n if self.context_size is None else validate.integer(self.context_size, name="context_size", min=1,
                                                                   max=n, error=SamplerConfigError)
        bs = model.cfg.extra["block_size"]
        if ctx % bs:
            raise SamplerConfigError(f"context_size={ctx} must be a multiple of block_size={bs}.",
                                     argument="context_size", value=ctx, allowed=f"a multiple of {bs}")
        return dataclasses.replace(self, **self.lengths(model), context_size=ctx, block_size=bs,
                                   first_hitting=validate.boolean(self.first_hitting, name="first_hitting"),
                                   kv_cache=validate.boolean(self.kv_cache, name="kv_cache"),
                                   nucleus_p=R.apply(self, "nucleus_p"))


# context_size is the window of the recomputing forward; the reference's KV cache (§3.4) attends to every stored
# block up to model_length and has no window of its own, so under kv_cache=True a context_size would do nothing
BD3LMSettings.rules = {**CanvasSettings.rules, "first_hitting": R.boolean(),
                       "nucleus_p": R.number(0, 1, low_open=True), "kv_cache": R.boolean(),
                       "context_size": R.integer(1, none=True, active=lambda s: not s.kv_cache,
                                                 when="kv_cache=False (the cached forward attends to every stored "
                                                      "block up to model_length, as the reference's cache does)",
                                                 on={"kv_cache": False}, off={"kv_cache": True})}


def nucleus(p_x0: Tensor, p: float) -> Tensor:
    """`_nucleus_sample`: keep the sorted prefix whose cumulative mass is ≤ p (the token crossing p is dropped),
    always the top-1, renormalise."""
    if p == 1.0:
        return p_x0
    probs, idx = p_x0.sort(dim=-1, descending=True)
    keep = probs.cumsum(dim=-1) <= p
    keep[..., 0] = True
    out = torch.zeros_like(p_x0).scatter_(-1, idx, probs * keep)
    return out / out.sum(-1, keepdim=True)


class Streams:
    """The reference's three random streams (see the module docstring)."""

    def __init__(self, generator: torch.Generator | None, device: torch.device):
        seed = None if generator is None else generator.initial_seed()
        self.np = np.random.RandomState(seed % 2**32 if seed is not None else None)
        self.cpu = generator
        self.dev = generator
        if generator is not None and device.type != "cpu":
            self.dev = torch.Generator(device).manual_seed(seed)
        self.device = device

    def gumbel_argmax(self, p: Tensor) -> Tensor:
        u = torch.rand(p.shape, dtype=p.dtype, device=self.device if self.dev is not None else "cpu",
                       generator=self.dev).to(p.device)
        return (p / (1e-10 - (u + 1e-10).log())).argmax(dim=-1)


class BD3LMSampler(DDiTSampler):
    name, Settings, family = "bd3lm", BD3LMSettings, "bd3lm"
    neutral = dict(nucleus_p=1.0, kv_cache=False)
    absent = dict(block_length="its block is the checkpoint's: config.json block_size, read into "
                               "model.cfg.extra['block_size'] and shown on out.settings; a model trained with another "
                               "block size is another checkpoint")

    def run_plan(self, s: Any, prompt_length: int) -> Plan:
        """This prompt's layout, block by block: an all-prompt block samples nothing (with `kv_cache` one forward
        stores it); a block holding generated positions runs `steps` sampling steps, or under first hitting (one
        commit a step) min(steps, its generated positions), then with `kv_cache` one storing forward once it holds
        no mask. First hitting's count is exact; otherwise a block may end early (it holds no mask), so the count
        is the most the run can make."""
        bs, total, kv = s.block_size, prompt_length + s.gen_length, int(s.kv_cache)
        n = 0
        for lo in range(0, total, bs):
            gen = min(lo + bs, total) - max(lo, prompt_length)
            if gen <= 0:
                n += kv
            elif s.first_hitting:
                n += min(s.steps, gen) + kv * int(gen <= s.steps)
            else:
                n += s.steps + kv
        return Plan(n, n_blocks=-(-total // bs),
                    adaptive=None if s.first_hitting else "BD3LM ends each block when it holds no mask")

    def plan(self, s: Any, prompt_length: int | None = None) -> Plan:
        """The most forwards: `steps` per block (+1 storing it with `kv_cache`). With the prompt length unknown
        (`mdm_lens.diffusion.generate.plan`) the bound counts the blocks a generation can touch, ⌈gen/bs⌉ + 1."""
        bs = s.block_size
        n_blocks = -(-s.gen_length // bs) + 1 if prompt_length is None else -(-(prompt_length + s.gen_length) // bs)
        return Plan(n_blocks * (s.steps + int(s.kv_cache)), n_blocks=n_blocks,
                    adaptive="BD3LM ends each block when it holds no mask")

    def forward_extents(self, s: Any, prompt_length: int) -> list[tuple[int, int, int, int]] | None:
        """Without kv_cache each step forwards a window of at most `context_size` positions and samples its block's
        rows; with it, one block against a cache of q, k and v (3·d_model a position, not the generic 2·kv·d_head:
        expressed as 1.5× the positions) preallocated over model_length."""
        total = prompt_length + s.gen_length
        if not s.kv_cache:
            window = min(total, s.context_size)
            return [(window, window, 0, s.block_size)]
        n = min(total, s.context_size)
        return [(s.block_size, n, 3 * s.context_size // 2, s.block_size)]

    def trajectory_bytes(self, s: Any, batch: int, prompt_length: int, steps: int) -> int:
        """One int64 canvas `[batch, prompt + gen]` per sampling step of every block holding a generated position:
        `steps` a block, or with first hitting (one commit a step, the block ends when unmasked) at most its
        generated positions. A storing forward commits nothing and records the same canvas tensor (no new bytes)."""
        bs, total = s.block_size, prompt_length + s.gen_length
        n = 0
        for lo in range(0, total, bs):
            gen = min(lo + bs, total) - max(lo, prompt_length)
            if gen > 0:
                n += min(s.steps, gen) if s.first_hitting else s.steps
        return n * batch * total * 8

    def carried_bytes(self, s: Any, dtype_bytes: int) -> tuple[int, int]:
        """The previous step's logits over the forward's rows (the window's full tensor under the block's view);
        with kv_cache, the storing forward also runs while the block's fp64 p(x0) is still referenced."""
        return dtype_bytes, 8 * int(s.kv_cache)

    def attention_extra_bytes(self, s: Any, cfg: Any, batch: int, extent: tuple[int, int, int, int],
                              dtype_bytes: int) -> int:
        """A cached forward reads every key back: `BD3KVCache.write` returns a copy of the layer's stored qkv
        `[batch, keys, 3·d_model]`, and rotating its k over all keys holds k·cos, rotate_half(k) and its ·sin
        (`[batch, keys, d_model]` each) at once."""
        return 6 * batch * extent[1] * cfg.d_model * dtype_bytes if extent[2] else 0

    def logit_bytes(self, s: Any, dtype_bytes: int) -> int:
        """Per block logit: SUBS' copy and normalised copy (model dtype), the fp64 p(x0) it keeps, then the fp64
        Gumbel draw's uniform, two live temporaries and, without first hitting, the fp64 q beside them."""
        return 2 * dtype_bytes + 8 * (4 + int(not s.first_hitting))

    def check_run(self, ids: Tensor, am: Tensor, s: Any, obs: Any) -> None:
        super().check_run(ids, am, s, obs)
        if s.first_hitting and ids.shape[0] != 1:
            raise SamplerConfigError(f"first_hitting=True samples one row at a time (the reference requires "
                                     f"eval_batch_size 1); got {ids.shape[0]} prompts.", argument="prompt",
                                     value=ids.shape[0], allowed="one prompt, or first_hitting=False")

    def _check_prompt(self, model: Any, ids: Tensor, gen_length: int) -> None:
        # no length limit: the canvas may exceed model_length, forwards see the last `context_size` positions (the
        # reference's sliding window; its KV cache slides by one block at model_length)
        mask_id = model.cfg.mask_token_id
        if bool((ids == mask_id).any()):
            raise InputError(f"the prompt contains the mask token {mask_id}; BD3LM fills masks only in the block "
                             "being decoded. Remove it.", argument="prompt", value=ids,
                             allowed=f"token ids other than {mask_id}")

    def check_ragged(self, model: Any, ids: Tensor, s: Any) -> None:
        """A canvas that ends mid-block runs a shorter last block (an extension: the reference's canvas is whole
        blocks); the cached form takes whole blocks only, so `kv_cache=True` needs prompt + gen a multiple of bs."""
        bs, total = s.block_size, ids.shape[1] + s.gen_length
        if s.kv_cache and total % bs:
            raise SamplerConfigError(f"kv_cache=True: prompt ({ids.shape[1]}) + gen_length ({s.gen_length}) = {total} "
                                     f"must be a multiple of block_size={bs} (the cached forward takes whole blocks "
                                     "from position 0).", argument="gen_length", value=s.gen_length,
                                     allowed=f"gen_length ≡ {-ids.shape[1] % bs} mod {bs}, or kv_cache=False")

    def check_inputs(self, model: Any, ids: Tensor, am: Tensor, s: Any, obs: Any) -> None:
        self.check_ragged(model, ids, s)
        super().check_inputs(model, ids, am, s, obs)

    def run(self, runner: Any, ids: Tensor, am: Tensor, model: Any, s: BD3LMSettings,
            generator: torch.Generator | None, bar: Any) -> tuple[Tensor, Tensor, TrajectoryRecorder]:
        mask_id, bs, (batch, p_len) = model.cfg.mask_token_id, model.cfg.extra["block_size"], ids.shape
        x = torch.cat([ids, ids.new_full((batch, s.gen_length), mask_id)], dim=1)
        prompt = torch.zeros_like(x, dtype=torch.bool)
        prompt[:, :p_len] = True
        recorder = TrajectoryRecorder(batch, x.shape[1], p_len, x.device)
        rng = Streams(generator, x.device)
        cache = model.new_kv_cache(batch) if s.kv_cache else None
        plan = self.run_plan(s, p_len)
        recorder.forwards = []  # one entry per step (`_note`): what `out.replay` rebuilds the step's forward from
        run = dict(step=0, n=plan.n_steps, n_blocks=plan.n_blocks, forwards=recorder.forwards)
        for b in range(run["n_blocks"]):
            x = self._block(runner, model, s, x, prompt, b, cache, rng, recorder, run, bar)
        # first hitting commits one position per step: fewer steps than masks per block leaves masks (the reference
        # returns them too)
        warn_masked_answer(x, p_len, model, self.name)
        return x, _full_mask(am, x), recorder

    def _forward(self, runner: Any, x: Tensor, prompt: Tensor, b: int, t: Tensor, sigma: Tensor, run: dict, s: Any,
                 cache: Any, store: bool = False) -> Tensor:
        bs = runner.model.cfg.extra["block_size"]
        lo, end = b * bs, min((b + 1) * bs, x.shape[1])  # a ragged last block ends with the canvas
        start = max((b + 1) * bs - s.context_size, 0)  # window aligned to whole blocks (the block-causal mask's)
        masked = x == runner.model.cfg.mask_token_id
        state = DenoisingState(run["step"], run["n"], b, run["n_blocks"], x.clone(), masked, prompt,
                               torch.ones_like(prompt), block_slice=slice(lo, end),
                               extra=dict(t=t.clone(), sigma=sigma.clone(), kv_store=store))
        if cache is None:
            state.query_rows, state.key_cols = slice(start, end), slice(start, end)
            _note(run, state, cached=False)
            return runner.forward(state, x[:, start:end], sigma=sigma)[:, lo - start:]
        state.query_rows = slice(end - bs, end)
        keys = cached_key_positions(run.setdefault("stored", []), cache.idx, end, bs)
        state.key_cols = slice(int(keys.min()), end)
        if keys.numel() != end - int(keys.min()):  # an unfinished block was skipped: not one run of positions
            state.key_index = keys
        _note(run, state, cached=True)
        out = runner.forward(state, x[:, end - bs:end], sigma=sigma, kv_cache=cache, store_kv=store)
        if store:  # the block's positions join the cache (which keeps the last model_length − block_size of them)
            run["stored"] = (run["stored"] + list(range(end - bs, end)))[-cache.idx:] if cache.idx else []
        return out

    def _block(self, runner: Any, model: Any, s: BD3LMSettings, x: Tensor, prompt: Tensor, b: int, cache: Any,
               rng: Streams, recorder: TrajectoryRecorder, run: dict, bar: Any) -> Tensor:
        mask_id, bs = model.cfg.mask_token_id, model.cfg.extra["block_size"]
        lo, end, batch = b * bs, min((b + 1) * bs, x.shape[1]), x.shape[0]
        ones = torch.ones((batch, 1), dtype=torch.float32)
        t: Any = 1
        timesteps, dt, p_x0 = torch.linspace(1, 0, s.steps), 1 / s.steps, None
        stepped = False  # a one-step loop also ends with i == 0, so `i` cannot tell an all-prompt block apart
        for i in range(s.steps):
            # the block is done when it holds no mask (the reference tests the whole canvas, which differs only
            # when an earlier block kept masks: first hitting with fewer steps than masks; there it would draw a
            # position among none)
            if not bool((x[:, lo:end] == mask_id).any()):
                break
            if s.first_hitting:
                t *= rng.np.rand() ** (1 / int((x[:, max(lo + bs - s.context_size, 0):end] == mask_id).sum()))
            else:
                t = timesteps[i]
            mc_t = t * ones
            mc_s = mc_t - dt
            sigma = torch.min(-torch.log(1 - mc_t), torch.tensor(SIGMA_MAX, dtype=torch.float32)).mean(-1)
            blk = x[:, lo:end]
            stepped = True
            if p_x0 is None:
                logits = self._forward(runner, x, prompt, b, mc_t[:, 0], sigma.to(x.device), run, s, cache)
                p_x0 = nucleus(subs(logits, blk, mask_id).to(torch.float64).exp(), s.nucleus_p)
                source = run["step"]
            else:  # this step runs no forward: it samples from step `source`'s p(x0) (its canvas is unchanged)
                _note_reuse(run, source, mc_t[:, 0], sigma)
            new = self._draw(p_x0, blk, mc_s / mc_t, mask_id, s.first_hitting, rng)
            x_new = torch.cat([x[:, :lo], new, x[:, end:]], dim=1)
            changed = x_new != x
            commit(runner, recorder, run["step"], x, x_new, b)
            run["step"] += 1
            if bar is not None:
                bar.update(1)
            if cache is not None and not bool((new == mask_id).any()):
                self._forward(runner, x_new, prompt, b, mc_t[:, 0], sigma.to(x.device), run, s, cache, store=True)
                commit(runner, recorder, run["step"], x_new, x_new, b)  # the storing forward commits nothing
                run["step"] += 1
            p_x0 = None if bool(changed.any()) else p_x0
            x = x_new
        if cache is not None and not stepped and not bool((x[:, lo:end] == mask_id).any()):
            # a block with no mask (all prompt): the reference never meets one; its keys are stored all the same
            zero = torch.zeros(batch, device=x.device)
            self._forward(runner, x, prompt, b, zero, zero, run, s, cache, store=True)
            commit(runner, recorder, run["step"], x, x, b)
            run["step"] += 1
        return x

    @staticmethod
    def _draw(p_x0: Tensor, blk: Tensor, mask_prob: Tensor, mask_id: int, first_hitting: bool, rng: Streams
              ) -> Tensor:
        if first_hitting:
            drawn = rng.gumbel_argmax(p_x0)
            masked = blk == mask_id
            k = torch.randint(0, int(masked.sum()), (blk.shape[0],), generator=rng.cpu)
            pos = masked.nonzero()[k.to(blk.device), 1]
            one = torch.arange(blk.shape[1], device=blk.device) == pos[:, None]
            drawn = torch.where(one, drawn, blk)
        else:
            q = p_x0 * (1 - mask_prob[:, None].to(p_x0.device))
            q[:, :, mask_id] = mask_prob.to(p_x0.device)
            drawn = rng.gumbel_argmax(q)
        return torch.where(blk != mask_id, blk, drawn)


def cached_key_positions(stored: list[int], n_stored: int, end: int, bs: int) -> Tensor:
    """The canvas positions a cached forward's keys are: the cache's stored positions (its last `n_stored`, as
    the cache slides) then the block's own `[end − bs, end)`."""
    return torch.tensor(stored[len(stored) - n_stored:] + list(range(end - bs, end)), dtype=torch.long)


def _note(run: dict, state: DenoisingState, cached: bool) -> None:
    """Keep step `state.step`'s forward for `out.replay` (mdm_lens.diffusion.window_replay): its rows, keys, t, σ,
    whether it read / stored the KV cache. The canvas is the trajectory's `x_steps[step]`, not copied again."""
    run["forwards"].append(dict(block=state.block, block_slice=state.block_slice, n_steps=state.n_steps,
                                n_blocks=state.n_blocks, rows=state.rows, keys=state.keys,
                                key_index=state.key_index,
                                extra=dict(t=state.extra["t"].detach().cpu().clone(),
                                           sigma=state.extra["sigma"].detach().cpu().clone(),
                                           kv_store=state.extra["kv_store"], kv_cache=cached)))


def _note_reuse(run: dict, source: int, t: Tensor, sigma: Tensor) -> None:
    """A step that ran no forward: the window step `source` forwarded, at this step's own t and σ."""
    f = run["forwards"][source]
    run["forwards"].append(dict(f, extra=dict(f["extra"], t=t.detach().cpu().clone(),
                                              sigma=sigma.detach().cpu().clone(), reused_from=source)))


register(BD3LMSampler())
