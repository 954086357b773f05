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

from mdm_lens import validate
from mdm_lens.diffusion.canvas import CanvasSampler, CanvasSettings, Plan, masked_canvas
from mdm_lens.diffusion.output import TrajectoryRecorder
from mdm_lens.diffusion.registry import register, resolved
from mdm_lens.diffusion.schedules import llada_transfer_counts
from mdm_lens.diffusion.state import DenoisingState
from mdm_lens.errors import SamplerConfigError

REMASKING = ("low_confidence", "random")


def add_gumbel_noise(logits: Tensor, temperature: float, generator: torch.Generator | None) -> Tensor:
    """exp(logits) / (−log u)^T in float64: its argmax is a sample from softmax(logits / T).
    The reference insists on float64 (low-precision Gumbel noise hurts generation quality)."""
    if temperature == 0:
        return logits
    logits = logits.to(torch.float64)
    u = torch.rand(logits.shape, generator=generator, dtype=torch.float64, device="cpu").to(logits.device)
    return logits.exp() / (-torch.log(u)) ** temperature


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
        return dataclasses.replace(s, **special_ids(model, s))


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
    neutral = dict(cfg_scale=0.0, remasking="low_confidence", logits_eos_inf=False, confidence_eos_eot_inf=False,
                   block_length=None)

    def is_neutral(self, option: str, value: Any, given: dict[str, Any]) -> bool:
        gen_length = given.get("gen_length")
        if option == "block_length" and value is not None and gen_length is not None and value == gen_length:
            return True  # one block: what the other samplers do
        return super().is_neutral(option, value, given)

    def plan(self, s: LLaDASettings) -> Plan:
        return Plan(s.steps, s.gen_length // s.block_length,
                    ("cond", "uncond") if s.cfg_scale > 0 else ("cond",))

    def idle_steps(self, s: LLaDASettings) -> list[int]:
        n_blocks = s.gen_length // s.block_length
        per_block = llada_transfer_counts(torch.ones(1, s.block_length, dtype=torch.bool), s.steps // n_blocks)
        counts = per_block[0].tolist() * n_blocks
        return [step for step, c in enumerate(counts) if c == 0]

    def run(self, runner: Any, ids: Tensor, am: Tensor, model: Any, s: LLaDASettings,
            generator: torch.Generator | None, bar: Any) -> tuple[Tensor, Tensor, TrajectoryRecorder]:
        x, am = masked_canvas(ids, am, s.gen_length, model.cfg.mask_token_id)
        x, recorder = llada_sample(
            runner, x, am, ids.shape[1], steps=s.steps, gen_length=s.gen_length, block_length=s.block_length,
            temperature=s.temperature, cfg_scale=s.cfg_scale, remasking=s.remasking,
            mask_id=model.cfg.mask_token_id, logits_eos_inf=s.logits_eos_inf,
            confidence_eos_eot_inf=s.confidence_eos_eot_inf, eos_id=s.eos_id, eot_id=s.eot_id, generator=generator,
            progress=bar)
        return x, am, recorder


register(LLaDASampler())
