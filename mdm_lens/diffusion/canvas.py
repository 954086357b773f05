"""What the samplers over a token canvas (LLaDA, Dream, the ARM twins, and the block samplers built on them)
share: `steps` / `gen_length` resolution, the prompt and context checks, the step runner's set-up before any
compute, and the `GenerateOutput`. A sampler supplies its loop (`run`) and its plan (steps, blocks, phases)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mdm_lens.diffusion import rules as R
from mdm_lens import tokenization, validate
from mdm_lens.diffusion import arguments
from mdm_lens.diffusion.output import GenerateOutput, model_key
from mdm_lens.diffusion.registry import Observation, Sampler, SamplerSettings, progress_bar
from mdm_lens.errors import InputError, SamplerConfigError
from mdm_lens.hooks.runner import StepRunner

DEFAULT_GEN_LENGTH = 32


@dataclass
class CanvasSettings(SamplerSettings):
    """`gen_length`: tokens to generate (default the canvas a zoo twin was trained on, `cfg.extra["gen_length"]`,
    else 32); `steps`: denoising steps (default gen_length, LLaDA's official setting)."""

    steps: int | None = None
    gen_length: int | None = None

    def lengths(self, model: Any) -> dict[str, int]:
        gl = self.gen_length
        if gl is None:
            gl = model.cfg.extra.get("gen_length", DEFAULT_GEN_LENGTH)
        gen_length = validate.integer(gl, name="gen_length", min=1, error=SamplerConfigError)
        steps = gen_length if self.steps is None else validate.integer(self.steps, name="steps", min=1,
                                                                         error=SamplerConfigError)
        return dict(steps=steps, gen_length=gen_length)

    def temperature_or(self, default: float) -> float:
        t = getattr(self, "temperature")
        return validate.number(default if t is None else t, name="temperature", min=0, error=SamplerConfigError)


CanvasSettings.rules = {"steps": R.integer(1, none=True), "gen_length": R.integer(1, none=True)}

@dataclass(frozen=True)
class Plan:
    """What the step runner must know before the first forward."""

    n_steps: int  # adaptive runs: the most forwards the run can make (it may stop earlier)
    n_blocks: int = 1
    phases: tuple[str, ...] = ("cond",)
    adaptive: str | None = None  # why the run's length is known only at its end (None: it is fixed)


class CanvasSampler(Sampler):
    """A sampler that writes `gen_length` tokens after the prompt, one hooked forward per step."""

    causal: bool = False  # True: decodes left to right and needs a causal model

    def plan(self, s: Any) -> Plan:
        return Plan(s.steps)

    def run_plan(self, s: Any, prompt_length: int) -> Plan:
        """The plan of a run on a prompt of this length (`generate` sizes hooks, caches and block selections by it);
        samplers whose layout depends on the prompt (BD3LM's blocks) override it."""
        return self.plan(s)

    def run_extent(self, s: Any, batch: int, prompt_length: int) -> tuple[int, int]:
        """Every forward the run's plan counts (MDLM / Duo: the noise-removal forward too) over the canvas."""
        return self.run_plan(s, prompt_length).n_steps, prompt_length + s.gen_length

    def idle_steps(self, s: Any) -> list[int] | None:
        """Steps that commit nothing when steps > gen_length (None: not known in advance)."""
        return None

    def check_run(self, ids: Tensor, am: Tensor, s: Any, obs: Observation) -> None:
        """A sampler's own limits on the prompt batch and the observation (one row only, no padding, ...),
        raised before compute."""

    def run(self, runner: StepRunner, ids: Tensor, am: Tensor, model: Any, s: Any,
            generator: torch.Generator | None, bar: Any) -> tuple[Tensor, Tensor, Any]:
        raise NotImplementedError

    def check_model(self, model: Any) -> None:
        causal = model.cfg.attention == "causal"
        if self.causal and not causal:
            raise SamplerConfigError(f"sampler={self.name!r} decodes left to right and needs a causal model; this "
                                     "model is bidirectional (use 'llada', 'dream' or 'auto').", argument="sampler",
                                     value=self.name, allowed="'llada', 'dream' or 'auto'")
        if not self.causal and causal:
            raise SamplerConfigError(f"{model.cfg.model_name} is causal: use sampler='arm' (or 'auto').",
                                     argument="sampler", value=self.name, allowed="'arm' or 'auto'")
        if not self.causal and model.cfg.mask_token_id is None:
            raise SamplerConfigError("this model has no mask token (cfg.mask_token_id is None); set it to diffuse.")

    def check_inputs(self, model: Any, ids: Tensor, am: Tensor, s: Any, obs: Observation) -> None:
        self._check_prompt(model, ids, s.gen_length)
        self.check_run(ids, am, s, obs)

    def generate(self, model: Any, prompt: Any, s: Any, obs: Observation) -> GenerateOutput:
        ids, am = arguments.prompt_tokens(model, prompt, obs.attention_mask)
        batch, prompt_length = ids.shape
        self.check_inputs(model, ids, am, s, obs)
        runner = StepRunner(model, fwd_hooks=obs.fwd_hooks, hook_steps=obs.hook_steps, record=obs.record,
                            cache=obs.cache)
        plan = self.run_plan(s, prompt_length)
        if plan.adaptive:
            runner.refuse_end_relative(plan.adaptive)
        runner.begin(batch, prompt_length + s.gen_length, plan.n_steps, n_blocks=plan.n_blocks,
                     phases=plan.phases)  # before compute
        idle = self.idle_steps(s)
        if not plan.adaptive or idle:  # an adaptive run warns for the steps its schedule leaves idle (RND1)
            arguments.warn_idle(idle, plan.n_steps, s.gen_length)
        generator = torch.Generator().manual_seed(obs.seed) if obs.seed is not None else None
        bar = progress_bar(obs.progress, plan.n_steps, f"{self.name} sampling")
        settings = dict(s.as_dict(), seed=obs.seed)
        if not self.causal:
            settings["mask_id"] = model.cfg.mask_token_id
        try:
            with torch.no_grad():
                x, am, recorder = self.run(runner, ids, am, model, s, generator, bar)
        finally:
            if bar is not None:
                bar.close()
        if plan.adaptive:
            runner.warn_unreached(len(recorder.x_steps))
        records, meta = runner.records()
        texts = None
        if model.tokenizer is not None:
            texts = [tokenization.decode(model.tokenizer, row[prompt_length:].tolist()) for row in x.cpu()]
        return GenerateOutput(tokens=x, prompt_length=prompt_length, attention_mask=am, trajectory=recorder.finish(),
                              sampler=self.name, settings=settings, causal=self.causal, records=records,
                              record_meta=meta, cache=runner.cache, model_name=model.cfg.model_name, texts=texts,
                              model_key=model_key(model))

    def _check_prompt(self, model: Any, ids: Tensor, gen_length: int) -> None:
        prompt_length = ids.shape[1]
        total = prompt_length + gen_length
        if total > model.cfg.n_ctx:
            raise SamplerConfigError(f"prompt ({prompt_length}) + gen_length ({gen_length}) = {total} exceeds the "
                                     f"context of {model.cfg.n_ctx}; shorten one of them.", argument="gen_length",
                                     value=gen_length, allowed=f"<= {model.cfg.n_ctx - prompt_length}")
        mask_id = model.cfg.mask_token_id
        if not self.causal and bool((ids == mask_id).any()):
            raise InputError(f"the prompt contains the mask token {mask_id}; LLaDA/Dream treat prompt masks as "
                             "positions to fill. Remove it or use a canvas made by generate.", argument="prompt",
                             value=ids, allowed=f"token ids other than {mask_id}")


def masked_canvas(ids: Tensor, am: Tensor, gen_length: int, mask_id: int) -> tuple[Tensor, Tensor]:
    """The prompt followed by `gen_length` mask tokens, and its attention mask."""
    batch = ids.shape[0]
    x = torch.cat([ids, ids.new_full((batch, gen_length), mask_id)], dim=1)
    return x, torch.cat([am, am.new_ones((batch, gen_length))], dim=1)
