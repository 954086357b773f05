"""LLaDA's sampler (`generate.py` of ML-GSAI/LLaDA), step by step and observable.

Semi-autoregressive blocks, a per-block transfer schedule, low-confidence or random remasking,
temperature through float64 Gumbel noise, classifier-free guidance with the prompt masked, and the
optional EOS/EoT logit suppression — as in the reference (architectures.md §2.5)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from mdm_lens.diffusion import rules as R
from mdm_lens import validate
from mdm_lens.diffusion import fastdllm
from mdm_lens.diffusion.canvas import CanvasSampler, CanvasSettings, Plan, masked_canvas
from mdm_lens.diffusion.output import TrajectoryRecorder
from mdm_lens.diffusion.noise import add_gumbel_noise
from mdm_lens.diffusion.registry import register, resolved
from mdm_lens.diffusion.schedules import llada_transfer_counts
from mdm_lens.diffusion.state import DenoisingState
from mdm_lens.errors import SamplerConfigError

REMASKING = ("low_confidence", "random")
RULES = ("llada", "eb")
KV_CACHES = ("prefix", "dual")


def llada_sample(runner: Any, x: Tensor, attention_mask: Tensor, prompt_length: int, *, steps: int,
                 gen_length: int, block_length: int, temperature: float = 0.0, cfg_scale: float = 0.0,
                 remasking: str = "low_confidence", mask_id: int, logits_eos_inf: bool = False,
                 confidence_eos_eot_inf: bool = False, eos_id: int | None = None, eot_id: int | None = None,
                 generator: torch.Generator | None = None, progress: Any = None) -> tuple[Tensor, TrajectoryRecorder]:
    batch, total = x.shape
    recorder = TrajectoryRecorder(batch, total, prompt_length, x.device)
    prompt_index = x != mask_id  # computed once; pads count as prompt (reference behaviour)
    n_blocks = gen_length // block_length
    steps_per_block = steps // n_blocks
    key_visible = attention_mask.bool()
    step = 0
    for b in range(n_blocks):
        blk = slice(prompt_length + b * block_length, prompt_length + (b + 1) * block_length)
        counts = llada_transfer_counts(x[:, blk] == mask_id, steps_per_block)
        for i in range(steps_per_block):
            mask_index = x == mask_id
            state = DenoisingState(step, steps, b, n_blocks, x.clone(), mask_index, prompt_index, key_visible, blk)
            logits = runner.forward(state, x, attention_mask=attention_mask)
            if cfg_scale > 0:
                # The reference masks pads too; pads are hidden keys and never committed, so keeping their pad id
                # changes no used logit and keeps the model's "pad is not the mask id" input check meaningful.
                un_x = x.masked_fill(prompt_index & key_visible, mask_id)
                uncond = DenoisingState(step, steps, b, n_blocks, un_x, un_x == mask_id, prompt_index, key_visible,
                                        blk, phase="uncond")
                un_logits = runner.forward(uncond, un_x, attention_mask=attention_mask)
                logits = un_logits + (cfg_scale + 1) * (logits - un_logits)
            if logits_eos_inf:
                logits[..., eos_id] = float("-inf")
            noisy = add_gumbel_noise(logits, temperature, generator)
            x0 = torch.argmax(noisy, dim=-1)
            if confidence_eos_eot_inf:
                # The reference line `logits_with_noise[..., EOS] = logits[..., EoT] = -inf`, after sampling. At
                # temperature 0 the noised tensor *is* the logits, so EOS and EoT confidences both drop to 0; at
                # temperature > 0 the EOS write lands in the noise copy and only EoT's confidence changes.
                if eos_id is not None:  # known whenever it matters (temperature 0): checked before the run
                    noisy[..., eos_id] = float("-inf")
                logits[..., eot_id] = float("-inf")
            if remasking == "low_confidence":
                p = F.softmax(logits, dim=-1)  # in the logits' dtype, as the reference
                x0_p = torch.gather(p, -1, x0[..., None]).squeeze(-1)
            else:
                x0_p = torch.rand(x0.shape, generator=generator, device="cpu").to(x.device)
            x0_p[:, blk.stop:] = float("-inf")  # never decode beyond the current block
            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p.to(torch.float32), torch.tensor(float("-inf"), device=x.device))
            transfer = torch.zeros_like(x0, dtype=torch.bool)
            for j in range(batch):
                _, select = torch.topk(confidence[j], k=int(counts[j, i]))
                transfer[j, select] = True
            x_in = state.x
            x = torch.where(transfer, x0, x)
            state.confidence, state.committed = confidence, transfer
            runner.end_step(state)
            recorder.record(step, b, x_in, transfer, confidence)
            if progress is not None:
                progress.update(1)
            step += 1
    return x, recorder


@dataclass
class LLaDASettings(CanvasSettings):
    """`generate.py`'s settings and defaults: temperature 0, no classifier-free guidance, low-confidence
    remasking, one block (`block_length` None = gen_length); `steps` must split evenly over the blocks."""

    block_length: int | None = None
    temperature: float = 0.0
    cfg_scale: float = 0.0
    remasking: str = "low_confidence"
    logits_eos_inf: bool = False
    confidence_eos_eot_inf: bool = False
    # Fast-dLLM parallel decoding (mdm_lens.diffusion.fastdllm): at most one of them
    threshold: float | None = None
    factor: float | None = None
    # "eb": EB-sampler over the whole canvas with error bound `gamma` (its reference default 0.1)
    sampler_rule: str = "llada"
    gamma: float | None = None
    # Fast-dLLM's approximate KV cache: "prefix" or "dual" (mdm_lens.kvcache)
    kv_cache: str | None = None
    eos_id: int | None = resolved()  # from the checkpoint, for the two suppression options
    eot_id: int | None = resolved()

    def resolve(self, model: Any) -> "LLaDASettings":
        n = self.lengths(model)
        bl = self.block_length
        block_length = n["gen_length"] if bl is None else validate.integer(bl, name="block_length", min=1,
                                                                           error=SamplerConfigError)
        check_blocks(n["steps"], n["gen_length"], block_length)
        s = dataclasses.replace(
            self, **n, block_length=block_length, temperature=self.temperature_or(0.0),
            remasking=validate.choice(self.remasking, REMASKING, name="remasking", error=SamplerConfigError),
            cfg_scale=validate.number(self.cfg_scale, name="cfg_scale", min=0, error=SamplerConfigError),
            logits_eos_inf=validate.boolean(self.logits_eos_inf, name="logits_eos_inf"),
            confidence_eos_eot_inf=validate.boolean(self.confidence_eos_eot_inf, name="confidence_eos_eot_inf"))
        s = dataclasses.replace(s, **special_ids(model, s), **parallel_rule(s))
        return s


LLaDASettings.rules = {
    **CanvasSettings.rules, "block_length": R.integer(1, none=True), "temperature": R.number(0, none=True),
    "steps": R.steps_unless({"threshold": None, "factor": None, "sampler_rule": "llada"},
                            "threshold, factor or sampler_rule='eb' is set"),
    "cfg_scale": R.number(0), "remasking": R.choice(REMASKING), "logits_eos_inf": R.boolean(),
    "confidence_eos_eot_inf": R.boolean(), "threshold": R.number(0, 1, none=True),
    "factor": R.number(0, none=True, low_open=True), "sampler_rule": R.choice(RULES),
    "gamma": R.number(0, none=True, active=lambda s: s.sampler_rule == "eb", when="sampler_rule='eb'",
                      on={"sampler_rule": "eb"}),
    "kv_cache": R.choice(KV_CACHES, none=True),
}

def check_blocks(steps: int, gen_length: int, block_length: int) -> None:
    if gen_length % block_length:
        raise SamplerConfigError(f"gen_length={gen_length} is not a multiple of block_length={block_length}; "
                                 "LLaDA decodes whole blocks. Use block_length=gen_length for no blocks.",
                                 argument="block_length", value=block_length, allowed=f"a divisor of {gen_length}")
    n_blocks = gen_length // block_length
    if steps % n_blocks:
        raise SamplerConfigError(f"steps={steps} must be divisible by the number of blocks {n_blocks} "
                                 f"(gen_length/block_length); e.g. steps={n_blocks * max(1, steps // n_blocks)}.",
                                 argument="steps", value=steps, allowed=f"a multiple of {n_blocks}")


def parallel_rule(s: LLaDASettings) -> dict[str, Any]:
    """Fast-dLLM's `threshold` / `factor` and EB-sampler's `gamma`, checked against what their reference loops
    support (no guidance or EOS options in Fast-dLLM; no blocks and confidence by entropy in EB-sampler)."""
    rule = validate.choice(s.sampler_rule, RULES, name="sampler_rule", error=SamplerConfigError)
    threshold = None if s.threshold is None else validate.number(s.threshold, name="threshold", min=0, max=1,
                                                                 error=SamplerConfigError)
    factor = None if s.factor is None else validate.number(s.factor, name="factor", min=0, min_open=True,
                                                           error=SamplerConfigError)
    if threshold is not None and factor is not None:
        raise SamplerConfigError("threshold= and factor= are two Fast-dLLM rules; pass one.", argument="factor",
                                 value=factor, allowed="None when threshold is set")
    if rule != "eb" and s.gamma is not None:
        raise SamplerConfigError(f"gamma={s.gamma!r} is EB-sampler's error bound; pass sampler_rule='eb' with it.",
                                 argument="gamma", value=s.gamma, allowed="None unless sampler_rule='eb'")
    parallel = "Fast-dLLM's threshold/factor decoding" if rule != "eb" else "EB-sampler"
    if rule == "eb" or threshold is not None or factor is not None or s.kv_cache is not None:
        for name, neutral in (("logits_eos_inf", False), ("confidence_eos_eot_inf", False)):
            if getattr(s, name) != neutral:
                raise SamplerConfigError(f"{name}=True: {parallel} has no such option (its reference loop does not "
                                         "suppress EOS/EoT).", argument=name, value=True, allowed="False")
    if rule == "eb":
        if threshold is not None or factor is not None:
            raise SamplerConfigError("sampler_rule='eb' commits by entropy; threshold=/factor= are Fast-dLLM's rules.",
                                     argument="threshold" if threshold is not None else "factor",
                                     value=threshold if threshold is not None else factor, allowed="None with 'eb'")
        if s.block_length != s.gen_length:
            raise SamplerConfigError(f"block_length={s.block_length}: EB-sampler decodes the whole canvas at once "
                                     "(its reference has no blocks).", argument="block_length",
                                     value=s.block_length, allowed=f"None or {s.gen_length}")
        if s.remasking != "low_confidence":
            raise SamplerConfigError("remasking='random': EB-sampler ranks by entropy, not by a remasking rule.",
                                     argument="remasking", value=s.remasking, allowed="'low_confidence'")
        gamma = validate.number(0.1 if s.gamma is None else s.gamma, name="gamma", min=0, error=SamplerConfigError)
        if s.kv_cache is not None:
            raise SamplerConfigError("sampler_rule='eb' runs without a KV cache (its reference iterates the whole "
                                     "canvas).", argument="kv_cache", value=s.kv_cache, allowed="None with 'eb'")
        return dict(sampler_rule=rule, gamma=gamma, threshold=None, factor=None, kv_cache=None)
    kv = None if s.kv_cache is None else validate.choice(s.kv_cache, KV_CACHES, name="kv_cache",
                                                         error=SamplerConfigError)
    if (threshold is not None or factor is not None or kv is not None) and s.cfg_scale > 0:
        raise SamplerConfigError(f"cfg_scale={s.cfg_scale}: Fast-dLLM's loops have no classifier-free guidance.",
                                 argument="cfg_scale", value=s.cfg_scale, allowed="0")
    if kv is not None and threshold is None and factor is None and s.steps // (s.gen_length // s.block_length) < 2:
        raise SamplerConfigError(f"kv_cache={kv!r} with the block schedule needs at least 2 steps per block: after "
                                 "the block-start forward the reference reads the schedule's second count (it fails "
                                 "with one step per block).", argument="steps", value=s.steps,
                                 allowed=f">= {2 * (s.gen_length // s.block_length)}")
    return dict(sampler_rule=rule, gamma=None, threshold=threshold, factor=factor, kv_cache=kv)


def special_ids(model: Any, s: LLaDASettings) -> dict[str, Any]:
    """EOS / EoT ids for LLaDA's suppression options, from the checkpoint (filled by the loaders).

    The reference line `logits_with_noise[..., EOS] = logits[..., EoT] = -inf` touches EoT always and EOS only at
    temperature 0 (where the noised logits are the logits themselves); an id the option would touch must be known."""
    eos = model.cfg.eos_token_id
    eot = model.cfg.extra.get("eot_token_id")
    if eot is None:
        eot = model.cfg.extra.get("special_tokens", {}).get("<|eot_id|>")
    if s.logits_eos_inf and eos is None:
        raise SamplerConfigError("logits_eos_inf=True but the model's EOS id is unknown (cfg.eos_token_id is None); "
                                 "set it from the tokenizer.", argument="logits_eos_inf", value=True,
                                 allowed="a model with cfg.eos_token_id")
    if s.confidence_eos_eot_inf:
        missing = ["EoT (cfg.extra['eot_token_id'])"] if eot is None else []
        if s.temperature == 0 and eos is None:
            missing.append("EOS (cfg.eos_token_id)")
        if missing:
            raise SamplerConfigError(f"confidence_eos_eot_inf=True needs the {' and '.join(missing)} id, unknown "
                                     "for this model; set it from the checkpoint's tokenizer.",
                                     argument="confidence_eos_eot_inf", value=True, allowed="a model with EOS/EoT ids")
    return dict(eos_id=eos, eot_id=eot)


class LLaDASampler(CanvasSampler):
    name, Settings = "llada", LLaDASettings
    # do-nothing values only: remasking / sampler_rule select LLaDA's algorithms, which another sampler never runs
    neutral = dict(cfg_scale=0.0, logits_eos_inf=False, confidence_eos_eot_inf=False,
                   block_length=None, threshold=None, factor=None, gamma=None, kv_cache=None)

    def is_neutral(self, option: str, value: Any, given: dict[str, Any]) -> bool:
        gen_length = given.get("gen_length")
        if option == "block_length" and value is not None and gen_length is not None and value == gen_length:
            return True  # one block: what the other samplers do
        return super().is_neutral(option, value, given)

    def plan(self, s: LLaDASettings) -> Plan:
        phases = ("cond", "uncond") if s.cfg_scale > 0 else ("cond",)
        n_blocks = s.gen_length // s.block_length
        if s.sampler_rule == "eb":
            return Plan(s.gen_length, 1, phases, adaptive="EB-sampler commits as many tokens as its error bound allows")
        if s.kv_cache is not None:
            # the block schedule's cached loop: its steps // n_blocks counts per block, one forward each (the filling
            # forward commits the first; a block still masked after its last count is refused); a threshold /
            # factor rule commits at least one token per forward
            bound = (s.steps // n_blocks) * n_blocks if s.threshold is None and s.factor is None \
                else s.gen_length + 2 * n_blocks
            return Plan(bound, n_blocks, phases, adaptive="a cached Fast-dLLM loop runs until each block holds no mask")
        if s.threshold is not None or s.factor is not None:
            return Plan(s.gen_length, n_blocks, phases,
                        adaptive="Fast-dLLM's threshold/factor rule commits as many tokens as pass it")
        return Plan(s.steps, n_blocks, phases)

    def check_run(self, ids: Tensor, am: Tensor, s: LLaDASettings, obs: Any) -> None:
        from mdm_lens.hooks.reducers import KeyValueNorms, ReceivedAttention, TopKKeys

        other = [r for r in obs.record if not isinstance(r, (ReceivedAttention, KeyValueNorms, TopKKeys))]
        if s.kv_cache is not None and other:
            raise SamplerConfigError(f"record={[type(r).__name__ for r in other]} on a kv_cache={s.kv_cache!r} run: "
                                     "these reducers place rows at positions 0.. and a cached forward computes a "
                                     "window; ReceivedAttention, KeyValueNorms, TopKKeys (which follow the window and "
                                     "the cached keys), cache= and fwd_hooks work.", argument="record",
                                     value=obs.record, allowed="ReceivedAttention, KeyValueNorms, TopKKeys")
        if s.kv_cache is not None and not bool(am.all()):
            raise SamplerConfigError(f"kv_cache={s.kv_cache!r} on a padded batch: Fast-dLLM's cached loops take "
                                     "prompts of one length and attend without a padding mask; batch prompts of "
                                     "equal length (or drop kv_cache).", argument="attention_mask", value=am,
                                     allowed="no padding")
        if s.sampler_rule == "eb" and ids.shape[0] != 1:
            raise SamplerConfigError(f"sampler_rule='eb' on a batch of {ids.shape[0]} prompts: EB-sampler's reference "
                                     "decodes one prompt at a time; pass one row.", argument="prompt",
                                     value=tuple(ids.shape), allowed="a [1, pos] prompt")

    def idle_steps(self, s: LLaDASettings) -> list[int]:
        n_blocks = s.gen_length // s.block_length
        per_block = llada_transfer_counts(torch.ones(1, s.block_length, dtype=torch.bool), s.steps // n_blocks)
        counts = per_block[0].tolist() * n_blocks
        return [step for step, c in enumerate(counts) if c == 0]

    def run(self, runner: Any, ids: Tensor, am: Tensor, model: Any, s: LLaDASettings,
            generator: torch.Generator | None, bar: Any) -> tuple[Tensor, Tensor, TrajectoryRecorder]:
        x, am = masked_canvas(ids, am, s.gen_length, model.cfg.mask_token_id)
        mask_id, budget = model.cfg.mask_token_id, s.gen_length
        if s.sampler_rule == "eb":
            x, recorder = fastdllm.eb_sample(runner, x, am, ids.shape[1], gamma=s.gamma, temperature=s.temperature,
                                             cfg_scale=s.cfg_scale, mask_id=mask_id, budget=budget,
                                             generator=generator, progress=bar)
            return x, am, recorder
        if s.kv_cache is not None:
            x, recorder = fastdllm.cached_sample(
                runner, model, x, am, ids.shape[1], kv_cache=s.kv_cache, steps=s.steps, gen_length=s.gen_length,
                block_length=s.block_length, temperature=s.temperature, remasking=s.remasking, mask_id=mask_id,
                threshold=s.threshold, factor=s.factor, budget=self.plan(s).n_steps,
                generator=generator, progress=bar)
            return x, am, recorder
        if s.threshold is not None or s.factor is not None:
            x, recorder = fastdllm.fastdllm_sample(
                runner, x, am, ids.shape[1], gen_length=s.gen_length, block_length=s.block_length,
                temperature=s.temperature, remasking=s.remasking, mask_id=mask_id, threshold=s.threshold,
                factor=s.factor, budget=budget, generator=generator, progress=bar)
            return x, am, recorder
        x, recorder = llada_sample(
            runner, x, am, ids.shape[1], steps=s.steps, gen_length=s.gen_length, block_length=s.block_length,
            temperature=s.temperature, cfg_scale=s.cfg_scale, remasking=s.remasking,
            mask_id=model.cfg.mask_token_id, logits_eos_inf=s.logits_eos_inf,
            confidence_eos_eot_inf=s.confidence_eos_eot_inf, eos_id=s.eos_id, eot_id=s.eot_id, generator=generator,
            progress=bar)
        return x, am, recorder


register(LLaDASampler())
