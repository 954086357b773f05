"""Nemotron-Labs-Diffusion's samplers, step by step and observable (the hub model's `generate` and `ar_generate`,
shared/specs/families-2.md §9.5; the hub file is not public: transcribed from a third-party copy of it).

`sampler="nemotron"` (`generate(prompt_ids, max_new_tokens, block_length, threshold, causal_context=True,
temperature)`): blocks of `block_length` start right after the prompt (not aligned at position 0).
1. A causal forward over the prompt (kind "prefill") fills the KV cache; its last logit (AR alignment: the next
   token) gives the AR seed `next_token` (argmax, or a draw from softmax(logit / T)).
2. Per block: the block is `[next_token, MASK, ...]`; `block_length` steps at most, each a bidirectional forward
   of the block's rows over [cache; block] at their absolute positions (kind "denoise", logit i predicts token i),
   then LLaDA's transfer: x0 = argmax of `exp(logits_f64) / (-log u)^T` (u uniform float64; T = 0: the logits),
   confidence = softmax(logits)[x0] on masked positions; the step's count is LLaDA's even split of the block's
   masks over `block_length` steps (remainder first), or with `threshold` every masked position, ranked, whose
   confidence is not below it (the most confident always). The block stops early when a row holds EOS with no
   mask before it.
3. A causal forward (kind "commit") stores the block's causal keys/values and seeds the next block from its last
   logit. Here it recomputes the causal prefix [0, block end) (the cache then holds exactly the keys/values the
   reference's incremental causal forwards stored, up to float rounding); hooks on it see those rows.
Decoding stops once every row's generated tokens hold EOS: `out.answer_length` is then the first EOS of the
latest row + 1 (the reference returns that many tokens for every row); later blocks stay masks on the canvas.

`sampler="nemotron_ar"` (`ar_generate`): one causal forward per token over the sequence so far (kind "ar"), the
next token from its last logit (argmax or a draw at T > 0); stops when every row emits EOS.

Every forward (prefill, denoise, commit; ar) is one step of the trajectory, its `DenoisingState` kept in
`out.trajectory.forwards`: `out.replay(model, k)` re-runs step k's own forward exactly, a denoising step against its
KV cache rebuilt from the causal forward that filled it (`mdm_lens.diffusion.window_replay`).

Randomness is drawn from the run's seeded CPU generator (the reference uses the global RNG) in the reference's
order. Not reproduced: `causal_context=False` (its prefill/commit semantics live in the unseen modified
`modeling_ministral.py`), `max_thinking_tokens` / `end_think_token_id`, `linear_spec_generate`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from mdm_lens import tokenization, validate
from mdm_lens.diffusion import arguments
from mdm_lens.diffusion import rules as R
from mdm_lens.diffusion.blockwise import BlockRecorder, end_step
from mdm_lens.diffusion.canvas import CanvasSampler, Plan
from mdm_lens.diffusion.output import GenerateOutput, TrajectoryRecorder, model_key
from mdm_lens.diffusion.registry import Observation, SamplerSettings, progress_bar, register, resolved
from mdm_lens.diffusion.state import DenoisingState
from mdm_lens.errors import SamplerConfigError
from mdm_lens.hooks.runner import StepRunner
from mdm_lens.kvcache import KVCache

CHAT_BLOCK_LENGTH = 32  # chat/chat_dlm.py and the config class's block_size


@dataclass
class NemotronSettings(SamplerSettings):
    """`generate`'s settings: `gen_length` (its `max_new_tokens`, the card's 512; a multiple of block_length),
    `block_length` None = the checkpoint's `block_size`, `threshold` None = LLaDA's even schedule (the card passes
    0.9), `temperature` 0 = greedy, `steps` None or gen_length (block_length per block). `eos_id` is the checkpoint's EOS (config.json, default 2)."""

    gen_length: int = 512
    block_length: int | None = None
    threshold: float | None = None
    temperature: float = 0.0
    causal_context: bool = True
    steps: int | None = None
    eos_id: int | None = resolved()

    def resolve(self, model: Any) -> "NemotronSettings":
        err = SamplerConfigError
        bl = self.block_length if self.block_length is not None else model.cfg.extra.get("dlm_block_size",
                                                                                         CHAT_BLOCK_LENGTH)
        bl = validate.integer(bl, name="block_length", min=1, error=err)
        gl = validate.integer(self.gen_length, name="gen_length", min=1, error=err)
        if gl % bl:
            raise err(f"gen_length={gl} is not a multiple of block_length={bl} (the reference asserts it).",
                      argument="gen_length", value=gl, allowed=f"a multiple of {bl}")
        if not validate.boolean(self.causal_context, name="causal_context"):
            raise err("causal_context=False is not reproduced: its prefill and commit forwards depend on the unseen "
                      "modified modeling_ministral.py of the hub checkpoint.", argument="causal_context",
                      value=False, allowed="True")
        if self.steps is not None and validate.integer(self.steps, name="steps", min=1, error=err) != gl:
            raise err(f"steps={self.steps}: the reference runs block_length steps per block at most, i.e. gen_length="
                      f"{gl} in all (the sweeps' and LLaDA's meaning of steps); other budgets are not its algorithm.",
                      argument="steps", value=self.steps, allowed=f"None or {gl}")
        thr = None if self.threshold is None else validate.number(self.threshold, name="threshold", error=err)
        return dataclasses.replace(self, gen_length=gl, block_length=bl, threshold=thr, steps=gl,
                                   temperature=validate.number(self.temperature, name="temperature", min=0,
                                                               error=err),
                                   eos_id=model.cfg.eos_token_id)


NemotronSettings.rules = {"gen_length": R.integer(1), "block_length": R.integer(1, none=True),
                          "threshold": R.number(0, 1, none=True), "temperature": R.number(0),
                          "causal_context": R.boolean(), "steps": R.integer(1, none=True)}


@dataclass
class NemotronARSettings(SamplerSettings):
    """`ar_generate`'s settings: `gen_length` (its `max_new_tokens`, default 128), `temperature` (0: greedy)."""

    gen_length: int = 128
    temperature: float = 0.0
    eos_id: int | None = resolved()

    def resolve(self, model: Any) -> "NemotronARSettings":
        return dataclasses.replace(
            self, gen_length=validate.integer(self.gen_length, name="gen_length", min=1, error=SamplerConfigError),
            temperature=validate.number(self.temperature, name="temperature", min=0, error=SamplerConfigError),
            eos_id=model.cfg.eos_token_id)


NemotronARSettings.rules = {"gen_length": R.integer(1), "temperature": R.number(0)}


def pick_next(logit: Tensor, temperature: float, generator: torch.Generator | None) -> Tensor:
    """The AR token `[batch, 1]` from the last logit: argmax, or one draw from softmax(logit / T)."""
    if temperature > 0:
        probs = torch.softmax(logit / temperature, dim=-1)
        return torch.multinomial(probs.cpu(), 1, generator=generator).to(logit.device)
    return torch.argmax(logit, dim=-1, keepdim=True)


def even_split(masked: Tensor, steps: int) -> Tensor:
    """`_get_num_transfer_tokens`: per row `[batch, steps]`, masks // steps each, the first masks % steps one more."""
    count = masked.sum(dim=1, keepdim=True)
    out = (count // steps).expand(-1, steps).clone()
    out += torch.arange(steps, device=masked.device)[None] < (count % steps)
    return out


def transfer_index(logits: Tensor, temperature: float, masked: Tensor, block: Tensor, count: Tensor,
                   threshold: float | None, generator: torch.Generator | None) -> tuple[Tensor, Tensor, Tensor]:
    """`_get_transfer_index`: (x0, which positions to commit, confidence with -inf off the masks)."""
    noisy = logits
    if temperature > 0:  # Gumbel-max in float64, LLaDA's form: exp(logits) / (-log u)^T
        u = torch.rand(logits.shape, dtype=torch.float64, generator=generator).to(logits.device)
        noisy = logits.double().exp() / (-torch.log(u)) ** temperature
    x0 = noisy.argmax(dim=-1)
    x0_p = torch.gather(F.softmax(logits, dim=-1), -1, x0[..., None])[..., 0]
    x0 = torch.where(masked, x0, block)
    confidence = torch.where(masked, x0_p, torch.tensor(float("-inf"), dtype=x0_p.dtype, device=x0_p.device))
    chosen = torch.zeros_like(masked)
    ks = masked.sum(dim=1) if threshold is not None else count
    for j in range(confidence.shape[0]):
        order = torch.topk(confidence[j], k=int(ks[j])).indices
        chosen[j, order] = True
        if threshold is not None:  # the most confident always; the others only at or above the threshold
            chosen[j, order[1:][confidence[j, order[1:]] < threshold]] = False
    return x0, chosen, confidence


class _Run:
    """One sampler run's forwards: each a step with its `DenoisingState`, on a KV cache where asked."""

    def __init__(self, runner: StepRunner, model: Any, x: Tensor, prompt_length: int, plan: Plan, bar: Any):
        self.runner, self.model, self.x, self.plan, self.bar = runner, model, x, plan, bar
        self.prompt = torch.zeros_like(x, dtype=torch.bool)
        self.prompt[:, :prompt_length] = True
        self.cache = KVCache(model, x.shape[1])
        self.recorder = BlockRecorder(x.shape[1], prompt_length, x.device)
        self.recorder.inner = TrajectoryRecorder(x.shape[0], x.shape[1], prompt_length, x.device)  # every row
        self.step = 0

    def forward(self, kind: str, lo: int, hi: int, block: int) -> tuple[DenoisingState, Tensor]:
        """kind "prefill" / "commit" / "ar": causal over [0, hi), filling the cache; "denoise": bidirectional rows
        [lo, hi) over [cache; rows]."""
        x, mask_id = self.x, self.model.cfg.mask_token_id
        state = DenoisingState(self.step, self.plan.n_steps, block, self.plan.n_blocks, x.clone(),
                               x == mask_id if mask_id is not None else ~self.prompt, self.prompt,
                               torch.ones_like(self.prompt), slice(lo, hi))
        state.computes(0 if kind != "denoise" else lo, hi).extra.update(kind=kind, query_start=state.rows.start,
                                                                        query_end=hi, kv_age=self.cache.age.clone())
        positions = torch.arange(state.rows.start, hi, device=x.device)[None]
        if kind == "denoise":
            self.cache.computed(lo, hi, self.step)
            with self.cache.attached("block"):
                logits = self.runner.forward(state, x[:, lo:hi], position_ids=positions)
        else:
            causal = torch.ones(hi, hi, dtype=torch.bool, device=x.device).tril()
            self.cache.computed(0, hi, self.step)
            with self.cache.attached("fill"):
                logits = self.runner.forward(state, x[:, :hi], position_ids=positions, attn_mask=causal)
        return state, logits

    def seed(self, pos: int, token: Tensor) -> Tensor:
        """Write the AR seed `[batch, 1]` at `pos` (a block's slot 0); the commit mask of that step."""
        self.x[:, pos] = token[:, 0]
        committed = torch.zeros_like(self.prompt)
        committed[:, pos] = True
        return committed

    def end(self, state: DenoisingState, committed: Tensor | None = None, confidence: Tensor | None = None) -> None:
        committed = torch.zeros_like(self.prompt) if committed is None else committed
        end_step(self.runner, self.recorder, state, state.x, committed, confidence, self.bar)
        self.step += 1


class NemotronSampler(CanvasSampler):
    name, Settings = "nemotron", NemotronSettings
    renamed = {"max_new_tokens": "gen_length"}

    def plan(self, s: Any, prompt_length: int | None = None) -> Plan:
        n_blocks = s.gen_length // s.block_length
        return Plan(1 + n_blocks * (s.block_length + 1), n_blocks,
                    adaptive="Nemotron may commit several tokens per step (threshold) and stops at EOS")

    def forward_extents(self, s: Any, prompt_length: int) -> list[tuple[int, int, int, int]] | None:
        """The largest forward is the last causal one (commit, or an AR step): every row up to the canvas end,
        refilling the cache over them, its last logit sampled."""
        n = prompt_length + s.gen_length
        return [(n, n, n, 1)]

    def trajectory_bytes(self, s: Any, batch: int, prompt_length: int, steps: int) -> int:
        """x_steps and each forward's canvas copy (its note, for replay), int64, for every step of the plan."""
        return self.plan(s, prompt_length).n_steps * batch * (prompt_length + s.gen_length) * 16

    def check_model(self, model: Any) -> None:
        if model.cfg.mask_token_id is None:
            raise SamplerConfigError("this model has no mask token (cfg.mask_token_id is None; Nemotron's config "
                                     "default -1); set it to diffuse.", argument="sampler", value=self.name)

    def loop(self, run: _Run, s: NemotronSettings, generator: torch.Generator | None) -> list[int] | None:
        x, bl, mask_id, p = run.x, s.block_length, run.model.cfg.mask_token_id, int(run.prompt[0].sum())
        state, logits = run.forward("prefill", 0, p, 0)
        run.end(state, run.seed(p, pick_next(logits[:, -1], s.temperature, generator)))
        n_blocks = s.gen_length // bl
        for nb in range(n_blocks):
            lo, hi = p + nb * bl, p + (nb + 1) * bl
            counts = even_split(x[:, lo:hi] == mask_id, bl)
            for i in range(bl):
                masked = x[:, lo:hi] == mask_id
                if not bool(masked.any()):
                    break
                state, logits = run.forward("denoise", lo, hi, nb)
                x0, chosen, confidence = transfer_index(logits, s.temperature, masked, x[:, lo:hi], counts[:, i],
                                                        s.threshold, generator)
                x[:, lo:hi][chosen] = x0[chosen]
                committed, conf = torch.zeros_like(run.prompt), torch.full(x.shape, float("-inf"))
                committed[:, lo:hi], conf[:, lo:hi] = chosen, confidence.float().cpu()
                run.end(state, committed, conf.to(x.device))
                if s.eos_id is not None and _eos_ends_block(x[:, lo:hi], s.eos_id, mask_id):
                    break
            state, logits = run.forward("commit", lo, hi, nb)
            next_token = pick_next(logits[:, -1], s.temperature, generator)
            run.end(state, run.seed(hi, next_token) if nb + 1 < n_blocks else None)  # the last seed is dropped
            if s.eos_id is not None:
                is_eos = x[:, p:hi] == s.eos_id
                if bool(is_eos.any(dim=1).all()):
                    return [int(is_eos.long().argmax(dim=1).max()) + 1] * x.shape[0]
        return None

    def check_inputs(self, model: Any, ids: Tensor, am: Tensor, s: Any, obs: Observation) -> None:
        if not bool(am.all()):
            raise SamplerConfigError(f"sampler={self.name!r} decodes unpadded prompts of one length (the reference "
                                     "takes no attention mask).", argument="attention_mask", value=am,
                                     allowed="all ones")
        self._check_prompt(model, ids, s.gen_length)

    def generate(self, model: Any, prompt: Any, s: Any, obs: Observation) -> GenerateOutput:
        ids, am = arguments.prompt_tokens(model, prompt, obs.attention_mask)
        self.check_inputs(model, ids, am, s, obs)
        p = ids.shape[1]
        x = torch.cat([ids, ids.new_full((ids.shape[0], s.gen_length), model.cfg.mask_token_id or 0)], dim=1)
        runner = StepRunner(model, fwd_hooks=obs.fwd_hooks, hook_steps=obs.hook_steps, record=obs.record,
                            cache=obs.cache)
        plan = self.plan(s)
        runner.refuse_end_relative(plan.adaptive or "")
        runner.begin(x.shape[0], x.shape[1], plan.n_steps, n_blocks=plan.n_blocks, phases=plan.phases)
        generator = torch.Generator().manual_seed(obs.seed) if obs.seed is not None else None
        bar = progress_bar(obs.progress, plan.n_steps, f"{self.name} sampling")
        run = _Run(runner, model, x, p, plan, bar)
        try:
            with torch.no_grad():
                answer = self.loop(run, s, generator)
        finally:
            if bar is not None:
                bar.close()
        runner.warn_unreached(len(run.recorder.x_steps))
        records, meta = runner.records()
        texts = None
        if model.tokenizer is not None:
            n = s.gen_length if answer is None else answer[0]
            texts = [tokenization.decode(model.tokenizer, row[p:p + n].tolist()) for row in x.cpu()]
        return GenerateOutput(tokens=x, prompt_length=p, attention_mask=torch.ones_like(x), sampler=self.name,
                              trajectory=run.recorder.finish(), settings=dict(s.as_dict(), seed=obs.seed,
                                                                              mask_id=model.cfg.mask_token_id),
                              causal=False, records=records, record_meta=meta, cache=runner.cache,
                              model_name=model.cfg.model_name, texts=texts, model_key=model_key(model),
                              answer_length=answer)


def _eos_ends_block(block: Tensor, eos_id: int, mask_id: int) -> bool:
    """The reference's per-block break: some row holds EOS with no mask before its first EOS."""
    eos = block == eos_id
    if not bool(eos.any()):
        return False
    before = (block == mask_id) & ~eos.cumsum(dim=1).bool()
    return bool((eos.any(dim=1) & ~before.any(dim=1)).any())


class NemotronARSampler(NemotronSampler):
    name, Settings = "nemotron_ar", NemotronARSettings
    renamed = {"max_new_tokens": "gen_length"}

    def plan(self, s: Any, prompt_length: int | None = None) -> Plan:
        return Plan(s.gen_length, 1, adaptive="nemotron_ar stops when every row emits EOS")

    def check_model(self, model: Any) -> None:
        """The AR mode needs no mask token."""

    def loop(self, run: _Run, s: NemotronARSettings, generator: torch.Generator | None) -> list[int] | None:
        x, p = run.x, int(run.prompt[0].sum())
        for i in range(s.gen_length):
            state, logits = run.forward("ar", p + i - 1, p + i, 0)  # causal over the sequence so far
            token = pick_next(logits[:, -1], s.temperature, generator)
            x[:, p + i] = token[:, 0]
            committed = torch.zeros_like(run.prompt)
            committed[:, p + i] = True
            run.end(state, committed)
            if s.eos_id is not None and bool((token == s.eos_id).all()):
                return [i + 1] * x.shape[0]
        return None


register(NemotronSampler())
register(NemotronARSampler())
