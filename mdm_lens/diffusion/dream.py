"""Dream's `diffusion_generate` (HKUNLP/Dream `generation_utils.py`), step by step and observable.

Timesteps `linspace(1, eps, steps+1)`; algorithms `origin` (random unmasking w.p. 1 − s/t),
`maskgit_plus` (top-1 probability), `topk_margin` (p1 − p2), `entropy` (negative entropy); commits
by top-k or, with `alg_temp`, by sampling; temperature, top-p, top-k; logits already aligned (the
one-position shift) by the model (architectures.md §4.4)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mdm_lens.diffusion import rules as R
from mdm_lens import validate
from mdm_lens.diffusion.arguments import filters, optional
from mdm_lens.diffusion.dream_block import dream_block_sample
from mdm_lens.diffusion.canvas import CanvasSampler, CanvasSettings, Plan, masked_canvas
from mdm_lens.diffusion.noise import sample_tokens, top_k_logits, top_p_logits  # noqa: F401  (re-exported)
from mdm_lens.diffusion.output import TrajectoryRecorder
from mdm_lens.diffusion.registry import DEFAULT, register
from mdm_lens.diffusion.schedules import dream_schedule, dream_timesteps, dream_transfer_count
from mdm_lens.diffusion.state import DenoisingState
from mdm_lens.errors import SamplerConfigError

ALGORITHMS = ("origin", "maskgit_plus", "topk_margin", "entropy")


def dream_sample(runner: Any, x: Tensor, attention_mask: Tensor, prompt_length: int, *, steps: int,
                 mask_id: int, eps: float = 1e-3, alg: str = "origin", alg_temp: float | None = None,
                 temperature: float = 0.0, top_p: float | None = None, top_k: int | None = None,
                 generator: torch.Generator | None = None, progress: Any = None) -> tuple[Tensor, TrajectoryRecorder]:
    batch, total = x.shape
    recorder = TrajectoryRecorder(batch, total, prompt_length, x.device)
    prompt_index = torch.zeros_like(x, dtype=torch.bool)
    prompt_index[:, :prompt_length] = True
    key_visible = attention_mask.bool()
    ts = dream_timesteps(steps, eps, device=x.device)
    for i in range(steps):
        mask_index = x == mask_id
        state = DenoisingState(i, steps, 0, 1, x.clone(), mask_index, prompt_index, key_visible)
        logits = runner.forward(state, x, attention_mask=attention_mask)
        mask_logits = logits[mask_index]
        t, s = ts[i], ts[i + 1]
        confidence = torch.full(x.shape, float("-inf"), device=x.device)
        if alg == "origin":
            p_transfer = 1 - s / t if i < steps - 1 else 1
            x0 = torch.full(mask_logits.shape[:1], mask_id, dtype=x.dtype, device=x.device)
            chosen = torch.rand(x0.shape, generator=generator, device="cpu").to(x.device) < p_transfer
            if chosen.any():
                _, x0[chosen] = sample_tokens(mask_logits[chosen], temperature, top_p, top_k, generator=generator)
            x_new = x.clone()
            x_new[mask_index] = x0
            confidence[mask_index] = float("nan")  # origin commits in random order: no confidence
        else:
            conf, x0 = sample_tokens(mask_logits, temperature, top_p, top_k, margin_confidence=alg == "topk_margin",
                                     neg_entropy=alg == "entropy", generator=generator)
            n_mask_mean = mask_index.sum() / mask_index.shape[0]  # batch mean: a reference quirk, kept
            k = dream_transfer_count(n_mask_mean, t, s, last=i == steps - 1)
            full = torch.full(x.shape, float("-inf"), dtype=logits.dtype, device=x.device)
            full[mask_index] = conf
            confidence = full.float()
            x_new = x.clone()
            if k > 0:
                if alg_temp is None or alg_temp == 0:
                    _, transfer_index = torch.topk(full, k)
                else:
                    weights = torch.softmax(full / alg_temp, dim=-1)
                    transfer_index = torch.multinomial(weights.float().cpu(), k, generator=generator).to(x.device)
                candidate = torch.full_like(x, mask_id)
                candidate[mask_index] = x0.clone()
                rows = torch.arange(batch, device=x.device)[:, None].expand_as(transfer_index)
                x_new[rows, transfer_index] = candidate[rows, transfer_index]
        committed = mask_index & (x_new != mask_id)
        state.confidence, state.committed = confidence, committed
        runner.end_step(state)
        recorder.record(i, 0, state.x, committed, confidence)
        x = x_new
        if progress is not None:
            progress.update(1)
    return x, recorder


@dataclass
class DreamSettings(CanvasSettings):
    """`diffusion_generate` as users run it, without a `generation_config`: the unset sampling settings come from
    the model config's legacy generation attributes (transformers 4.x `PretrainedConfig`: temperature 1.0, top_p
    1.0, top_k 50), not from `DreamGenerationConfig`'s own defaults (0.0 / None / None) nor from the checkpoint's
    generation_config.json. So an unset `temperature` samples at 1.0 under a top-50 filter, exactly as there;
    pass `top_k=None` (or `top_p=None`) to switch a filter off. `steps` defaults to gen_length (the reference's
    512 does not depend on the length)."""

    temperature: float = 1.0
    top_p: float | None = 1.0
    top_k: int | None = 50
    alg: str = DEFAULT  # unset: "origin" (Dream), "entropy" / "confidence_threshold" with kv_cache
    alg_temp: float | None = None
    eps: float = 1e-3
    # Fast-dLLM's block decoding (mdm_lens.diffusion.dream_block): always with a KV cache, as there
    kv_cache: str | None = None
    block_length: int | None = None  # with kv_cache; Fast-dLLM's default 32
    threshold: float | None = None  # its `confidence_threshold` algorithm
    factor: float | None = None  # the factor rule in place of the threshold (no reference has it on Dream: dream_block)

    def resolve(self, model: Any) -> "DreamSettings":
        s = dataclasses.replace(
            self, **self.lengths(model), temperature=self.temperature_or(1.0), **filters(self.top_p, self.top_k),
            alg_temp=optional(self.alg_temp, lambda v: validate.number(v, name="alg_temp", min=0,
                                                                       error=SamplerConfigError)),
            eps=validate.number(self.eps, name="eps", min=0, max=1, min_open=True, max_open=True,
                                error=SamplerConfigError))
        return dataclasses.replace(s, **(_block_settings(s) if s.kv_cache is not None or s.threshold is not None
                                         or s.factor is not None else _plain_settings(s)))


def _parallel_rule(s: DreamSettings) -> str:
    on = [f"{k}={getattr(s, k)!r}" for k in ("threshold", "factor") if getattr(s, k) is not None]
    return " and ".join(on) + " (Fast-dLLM's parallel rule commits by confidence, without a schedule or sampling)"


_UNLESS_PARALLEL = dict(active=lambda s: s.threshold is None and s.factor is None,
                        when="threshold and factor are unset", off={"threshold": 0.9, "kv_cache": "prefix"},
                        inert_by=_parallel_rule)


DreamSettings.rules = {
    **CanvasSettings.rules, "temperature": R.number(0, none=True),
    "steps": R.steps_unless({"threshold": None, "factor": None}, "threshold or factor is set"),
    "top_p": R.number(0, 1, none=True, low_open=True), "top_k": R.integer(1, none=True),
    "alg": R.anything("an algorithm name (checked by resolve: origin, maskgit_plus, topk_margin, entropy, "
                      "confidence_threshold with kv_cache)"),
    # the threshold / factor rules commit by confidence alone: no timestep schedule (eps), no sampled order (alg_temp)
    "alg_temp": R.number(0, none=True, **_UNLESS_PARALLEL),
    "eps": R.number(0, 1, low_open=True, high_open=True, **_UNLESS_PARALLEL),
    "kv_cache": R.choice(("prefix", "dual"), none=True), "block_length": R.integer(1, none=True),
    "threshold": R.number(0, 1, none=True), "factor": R.number(0, none=True, low_open=True),
}

def _plain_settings(s: DreamSettings) -> dict[str, Any]:
    """Dream's own loop: one block (a block_length equal to gen_length says the same; any other needs kv_cache)."""
    if s.block_length is not None and s.block_length != s.gen_length:
        raise SamplerConfigError(f"block_length={s.block_length!r} on Dream is Fast-dLLM's block decoding, which runs "
                                 "with a KV cache: pass kv_cache='prefix' or 'dual'.", argument="block_length",
                                 value=s.block_length, allowed=f"None or {s.gen_length} (other values need kv_cache)")
    alg = validate.choice("origin" if s.alg is DEFAULT else s.alg, ALGORITHMS, name="alg", error=SamplerConfigError)
    if alg == "origin" and s.alg_temp:
        raise SamplerConfigError(f"alg_temp={s.alg_temp!r} with alg='origin': origin unmasks at random and never "
                                 "reads alg_temp (it samples which confident tokens to commit in maskgit_plus, "
                                 "topk_margin and entropy).", argument="alg_temp", value=s.alg_temp,
                                 allowed="None or 0 with 'origin', any value with the other algorithms")
    return dict(alg=alg, block_length=None)


def _block_settings(s: DreamSettings) -> dict[str, Any]:
    """Fast-dLLM's Dream loop: a cache is what it runs with; its non-threshold path ranks by entropy whatever `alg`
    says, so only "entropy" (or unset) is accepted, and `threshold` is its `confidence_threshold` algorithm (`factor`:
    the same loop with the factor rule, see dream_block)."""
    if s.kv_cache is None:
        raise SamplerConfigError("block_length= / threshold= / factor= on Dream are Fast-dLLM's block decoding, "
                                 "which runs with a KV cache: pass kv_cache='prefix' or 'dual'.", argument="kv_cache",
                                 value=None, allowed="'prefix' or 'dual'")
    from mdm_lens.kvcache import MODES

    kv = validate.choice(s.kv_cache, MODES, name="kv_cache", error=SamplerConfigError)
    threshold = optional(s.threshold, lambda v: validate.number(v, name="threshold", min=0, max=1,
                                                                error=SamplerConfigError))
    factor = optional(s.factor, lambda v: validate.number(v, name="factor", min=0, min_open=True,
                                                          error=SamplerConfigError))
    if threshold is not None and factor is not None:
        raise SamplerConfigError("threshold= and factor= are two Fast-dLLM rules; pass one.", argument="factor",
                                 value=factor, allowed="None when threshold is set")
    parallel = threshold is not None or factor is not None
    rule = "confidence_threshold" if parallel else "entropy"
    if s.alg is not DEFAULT and s.alg != rule:
        used = (f"the factor rule (factor={factor})" if factor is not None else
                f"the threshold rule (threshold={threshold})" if threshold is not None else "entropy")
        raise SamplerConfigError(f"alg={s.alg!r} with kv_cache: Fast-dLLM's Dream loop ranks by {used} whatever "
                                 f"alg says; leave alg unset" + (" with threshold= / factor=." if parallel else
                                                                 " or pass alg='entropy'."),
                                 argument="alg", value=s.alg, allowed=f"unset or {rule!r}")
    block = validate.integer(32 if s.block_length is None else s.block_length, name="block_length", min=1,
                             error=SamplerConfigError)
    if s.gen_length % block:
        raise SamplerConfigError(f"gen_length={s.gen_length} is not a multiple of block_length={block}.",
                                 argument="block_length", value=block, allowed=f"a divisor of {s.gen_length}")
    n_blocks = s.gen_length // block
    if not parallel and (s.steps % n_blocks or s.steps // n_blocks < 2):
        raise SamplerConfigError(f"steps={s.steps} must be a multiple of the {n_blocks} blocks with at least 2 per "
                                 "block: with one step per block the reference decodes only each block's first "
                                 "token and leaves the rest masked.", argument="steps", value=s.steps,
                                 allowed=f"a multiple of {n_blocks}, >= {2 * n_blocks}")
    return dict(kv_cache=kv, block_length=block, threshold=threshold, factor=factor, alg=rule)


class DreamSampler(CanvasSampler):
    name, Settings = "dream", DreamSettings
    # do-nothing values only: alg selects Dream's unmasking order and eps its schedule (not no-ops elsewhere)
    renamed = dict(remasking="alg; LLaDA's low-confidence order is alg='maskgit_plus'")
    neutral = dict(alg_temp=None, top_p=None, top_k=None, kv_cache=None, threshold=None,
                   factor=None)

    def forward_extents(self, s: DreamSettings, prompt_length: int) -> list[tuple[int, int, int, int]] | None:
        """Without kv_cache: one forward over the canvas whose masked rows (at most the answer's) are sampled;
        with it, Fast-dLLM's Dream loop (the generic cached forward)."""
        if s.kv_cache is not None:
            return None
        total = prompt_length + s.gen_length
        return [(total, total, 0, s.gen_length)]

    def logit_bytes(self, s: DreamSettings, dtype_bytes: int) -> int:
        """Without kv_cache, per sampled (masked-row) logit: the `logits[mask_index]` copy, origin's copy of the
        rows it transfers, and `sample_tokens`' own buffers (`noise.sample_tokens_bytes`)."""
        if s.kv_cache is not None:
            return super().logit_bytes(s, dtype_bytes)
        from mdm_lens.diffusion.noise import sample_tokens_bytes

        origin = s.alg == "origin"
        return dtype_bytes * (1 + int(origin)) + sample_tokens_bytes(
            dtype_bytes, s.temperature, s.top_p, s.top_k, margin_confidence=s.alg == "topk_margin",
            neg_entropy=s.alg == "entropy")

    def carried_bytes(self, s: DreamSettings, dtype_bytes: int) -> tuple[int, int]:
        """Without kv_cache the next forward runs while the previous step's logits and their masked rows'
        copy (`mask_logits`) are still referenced."""
        if s.kv_cache is not None:
            return super().carried_bytes(s, dtype_bytes)
        return dtype_bytes, dtype_bytes

    def plan(self, s: DreamSettings) -> Plan:
        if s.kv_cache is None:
            return Plan(s.steps)
        n_blocks = s.gen_length // s.block_length
        return Plan(s.gen_length + 2 * n_blocks, n_blocks,
                    adaptive="Fast-dLLM's Dream loop runs until each block holds no mask")

    def check_run(self, ids: Tensor, am: Tensor, s: DreamSettings, obs: Any) -> None:
        if s.kv_cache is None:
            return
        if not bool(am.all()):
            raise SamplerConfigError(f"kv_cache={s.kv_cache!r} on a padded batch: pass prompts of one length (the "
                                     "reference's padded cached path slices its mask by key).",
                                     argument="attention_mask", value=am, allowed="no padding")
        if (s.threshold is not None or s.factor is not None) and ids.shape[0] != 1:
            raise SamplerConfigError(f"{'threshold' if s.factor is None else 'factor'}= on Dream decodes one prompt at "
                                     "a time (the reference commits row 0 only).", argument="prompt",
                                     value=tuple(ids.shape), allowed="a [1, pos] prompt")
        from mdm_lens.hooks.reducers import KeyValueNorms, ReceivedAttention, TopKKeys

        other = [r for r in obs.record if not isinstance(r, (ReceivedAttention, KeyValueNorms, TopKKeys))]
        if other:
            raise SamplerConfigError(f"record={[type(r).__name__ for r in other]} on a kv_cache run: only "
                                     "ReceivedAttention, KeyValueNorms and TopKKeys follow the window rows and the "
                                     "cached keys.", argument="record", value=obs.record,
                                     allowed="ReceivedAttention, KeyValueNorms, TopKKeys")

    def idle_steps(self, s: DreamSettings) -> list[int] | None:
        if s.alg == "origin" or s.kv_cache is not None:
            return None  # random order
        return [step for step, c in enumerate(dream_schedule(s.gen_length, s.steps, s.eps)) if c == 0]

    def run(self, runner: Any, ids: Tensor, am: Tensor, model: Any, s: DreamSettings,
            generator: torch.Generator | None, bar: Any) -> tuple[Tensor, Tensor, TrajectoryRecorder]:
        x, am = masked_canvas(ids, am, s.gen_length, model.cfg.mask_token_id)
        if s.kv_cache is not None:
            x, recorder = dream_block_sample(
                runner, model, x, am, ids.shape[1], kv_cache=s.kv_cache, steps=s.steps, gen_length=s.gen_length,
                block_length=s.block_length, threshold=s.threshold, factor=s.factor, temperature=s.temperature,
                top_p=s.top_p,
                top_k=s.top_k, alg_temp=s.alg_temp, eps=s.eps, mask_id=model.cfg.mask_token_id,
                budget=self.plan(s).n_steps, generator=generator, progress=bar)
            return x, am, recorder
        x, recorder = dream_sample(runner, x, am, ids.shape[1], steps=s.steps, mask_id=model.cfg.mask_token_id,
                                   eps=s.eps, alg=s.alg, alg_temp=s.alg_temp, temperature=s.temperature,
                                   top_p=s.top_p, top_k=s.top_k, generator=generator, progress=bar)
        return x, am, recorder


register(DreamSampler())
