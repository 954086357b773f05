"""Samplers of the DDiT research diffusion LMs, step by step and observable: MDLM's `_sample` (predictors
`ddpm_cache` (default), `ddpm`; log-linear noise eps 1e-3, sampling eps 1e-5, greedy `noise_removal`) and Duo's
ch-1 `generate_samples` (uniform-state ancestral sampling, `use_float64`, `p_nucleus`, `noise_removal` "ancestral" /
"greedy" / none; few-step distilled checkpoints use steps=8, greedy). Reference: families-2.md §2.6-2.7, §4.5.

Each step's forward runs with `state.extra["t"]` and `["sigma"]` (the σ handed to the network, [batch]). The
references sample unconditionally over the whole canvas; here the canvas is the prompt followed by `gen_length`
generated positions, and the prompt is kept: MDLM keeps every unmasked token by construction (SUBS + copy), Duo's
prompt positions are restored after each update (an extension: the reference has no prompt). Randomness: one
generator (`seed`), drawn in the reference's order and dtype (Gumbel-max uniforms over [batch, pos, vocab] every
step, even when MDLM's cache is reused; Duo's prior ids by `randint` over the generated positions)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mdm_lens import validate
from mdm_lens.diffusion import rules as R
from mdm_lens.diffusion.canvas import CanvasSampler, CanvasSettings, Plan
from mdm_lens.diffusion.output import TrajectoryRecorder
from mdm_lens.diffusion.registry import register
from mdm_lens.diffusion.state import DenoisingState
from mdm_lens.errors import SamplerConfigError

NOISE_EPS = 1e-3  # LogLinearNoise(eps=1e-3) in both references


def loglinear_sigma(t: Tensor) -> Tensor:
    """MDLM's total noise −log1p(−(1−eps)·t) = −log α_t of Duo's ch-1 log-linear schedule."""
    return -torch.log1p(-(1 - NOISE_EPS) * t)


def sample_categorical(p: Tensor, generator: torch.Generator | None) -> Tensor:
    """The references' Gumbel-max draw: argmax(p / (1e-10 − log(u + 1e-10))), u uniform in p's dtype."""
    u = torch.rand(p.shape, generator=generator, dtype=p.dtype).to(p.device)
    return (p / (1e-10 - (u + 1e-10).log())).argmax(dim=-1)


@dataclass
class DDiTSettings(CanvasSettings):
    steps: int | None = 128
    eps: float = 1e-5  # sampling eps: the last time of the linspace(1, eps, steps + 1) grid

    def checked(self, model: Any, **changes: Any) -> dict[str, Any]:
        return dict(**self.lengths(model), eps=R.apply(self, "eps"), **changes)


class DDiTSampler(CanvasSampler):
    family: str
    # MDLM, Duo and GIDD denoise the whole canvas at every step (MDLM's semi-AR mode is not implemented)
    absent = dict(block_length="it denoises the whole canvas at every step: it has no blocks")

    def check_model(self, model: Any) -> None:
        if model.cfg.family != self.family:
            raise SamplerConfigError(f"sampler={self.name!r} runs {self.family} checkpoints; this model is "
                                     f"{model.cfg.family!r}.", argument="sampler", value=self.name,
                                     allowed=f"a {self.family} model")

    def plan(self, s: Any) -> Plan:
        return Plan(s.steps + (1 if s.noise_removal in (True, "greedy") else 0))

    def generate(self, model: Any, prompt: Any, s: Any, obs: Any) -> Any:
        # steps discretise time here, not a token budget (MDLM runs 1000 steps over 1024 tokens; a step may commit
        # nothing, or with Duo change tokens anywhere): the canvas samplers' idle-step warning does not apply
        import warnings

        from mdm_lens.diffusion.arguments import IdleStepsWarning

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", IdleStepsWarning)
            return super().generate(model, prompt, s, obs)

    def check_run(self, ids: Tensor, am: Tensor, s: Any, obs: Any) -> None:
        if not bool(am.all()):
            raise SamplerConfigError("a padded prompt batch: DDiT models attend to every position (no padding mask); "
                                     "give prompts of one length.", argument="attention_mask", value=am,
                                     allowed="no padding")

    def forward(self, runner: Any, step: int, n_steps: int, x: Tensor, prompt: Tensor, t: Tensor, sigma: Tensor,
                mask_id: int | None, masked: Tensor | None = None) -> Tensor:
        masked = noisy_positions(x, prompt, mask_id) if masked is None else masked  # GIDD passes its hybrid rule
        state = DenoisingState(step, n_steps, 0, 1, x.clone(), masked, prompt,
                               torch.ones_like(prompt), extra=dict(t=t.clone(), sigma=sigma.clone()))
        return runner.forward(state, x, sigma=sigma)

    def sigma_of(self, t: Tensor) -> Tensor:
        return loglinear_sigma(t)

    def step_time(self, settings: dict, step: int, batch: int) -> tuple[Tensor, Tensor]:
        """(t, σ) `[batch]` of step `step` of a run with these settings: `linspace(1, eps, steps + 1)[step]`, the
        noise-removal step at the grid's last point, as the loops above compute them."""
        ts = torch.linspace(1, settings["eps"], settings["steps"] + 1)
        t = ts[min(step, settings["steps"])] * torch.ones(batch)
        return t, self.sigma_of(t)

    def replay_state(self, out: Any, state: DenoisingState) -> DenoisingState:
        t, sigma = self.step_time(out.settings, state.step, state.x.shape[0])
        state.extra.update(t=t, sigma=sigma)
        state.masked = noisy_positions(state.x, state.prompt, out.settings["mask_id"])
        return state


def masked_canvas(ids: Tensor, gen_length: int, mask_id: int) -> tuple[Tensor, Tensor, TrajectoryRecorder]:
    """The prompt followed by `gen_length` mask ids, its prompt index and a recorder of that canvas (the MDLM and GIDD
    loops start from it)."""
    batch, p_len = ids.shape
    x = torch.cat([ids, ids.new_full((batch, gen_length), mask_id)], dim=1)
    prompt = torch.zeros_like(x, dtype=torch.bool)
    prompt[:, :p_len] = True
    return x, prompt, TrajectoryRecorder(batch, x.shape[1], p_len, x.device)


def noisy_positions(x: Tensor, prompt: Tensor, mask_id: int | None) -> Tensor:
    """`DenoisingState.masked` of a DDiT step. MDLM: the positions holding the mask id. Duo (uniform-state, no mask
    token): every generated position, since each one holds a token the sampler may still resample until the run's
    last step (nothing is ever committed before the end); `trajectory.commit_step` is the last step that changed it."""
    return x == mask_id if mask_id is not None else ~prompt


def commit(runner: Any, recorder: TrajectoryRecorder, step: int, x: Tensor, x_new: Tensor, block: int = 0) -> None:
    """Record step `step` of block `block` (committed = the positions it changed) and, when the step ran a forward
    (an MDLM `ddpm_cache` / BD3LM step that reused p(x0) did not), close it for the reducers with its post-commit
    state."""
    recorder.record(step, block, x, x_new != x, None)
    state = getattr(runner, "last_state", None)
    if state is not None and state.step == step:
        state.committed = x_new != x
        runner.end_step(state)
    elif hasattr(runner, "no_forward"):  # a reuse step: reducers scheduled here say so in their meta
        runner.no_forward(step, block)


def warn_masked_answer(x: Tensor, prompt_length: int, model: Any, sampler: str) -> None:
    """A masked-state run (MDLM, BD3LM, GIDD) whose answer still holds the mask id when its steps ran out warns
    (`MaskedAnswerWarning`, as LLaDA2): the tokens are returned as the reference returns them, never silently."""
    from mdm_lens.diffusion.arguments import warn_masked

    n = x.shape[1] - prompt_length
    warn_masked(x, prompt_length, [n] * x.shape[0], model.cfg.mask_token_id, sampler)


def _full_mask(am: Tensor, x: Tensor) -> Tensor:
    """The prompt's attention mask extended over the generated positions (GenerateOutput's mask spans the canvas)."""
    return torch.cat([am, am.new_ones((am.shape[0], x.shape[1] - am.shape[1]))], dim=1)


def _greedy_final(sampler: DDiTSampler, runner: Any, x: Tensor, prompt: Tensor, n: int, eps: float,
                  sigma_of: Any, mask_id: int | None, recorder: TrajectoryRecorder) -> Tensor:
    t = torch.full((x.shape[0],), eps)
    logits = sampler.forward(runner, n, n + 1, x, prompt, t, sigma_of(t), mask_id)
    if mask_id is not None:  # SUBS: argmax of the log-probs (never the mask, unmasked tokens kept)
        from mdm_lens.ddit.outputs import subs

        logits = subs(logits, x, mask_id)
    x_new = torch.where(prompt, x, logits.argmax(dim=-1))
    commit(runner, recorder, n, x, x_new)
    return x_new


@dataclass
class MDLMSettings(DDiTSettings):
    """`Diffusion._sample`'s settings: predictor "ddpm_cache" (default), "ddpm" or "analytic" (the score-based update,
    `mdm_lens.diffusion.mdlm_analytic`; its noise removal is `_denoiser_update`, a draw, not an argmax), steps 128,
    noise_removal True."""

    predictor: str = "ddpm_cache"
    noise_removal: bool = True

    def resolve(self, model: Any) -> "MDLMSettings":
        return dataclasses.replace(self, **self.checked(
            model, predictor=validate.choice(self.predictor, MDLM_PREDICTORS, name="predictor",
                                             error=SamplerConfigError),
            noise_removal=validate.boolean(self.noise_removal, name="noise_removal")))


MDLM_PREDICTORS = ("ddpm_cache", "ddpm", "analytic")
# eps is the last time of the grid: 0 would ask for σ(0) (no noise), 1 for an empty grid
EPS_RULE = R.number(0, 1, low_open=True, high_open=True)
MDLMSettings.rules = {**CanvasSettings.rules, "eps": EPS_RULE, "predictor": R.choice(MDLM_PREDICTORS),
                      "noise_removal": R.boolean()}


class MDLMSampler(DDiTSampler):
    name, Settings, family = "mdlm", MDLMSettings, "mdlm"

    def carried_bytes(self, s: MDLMSettings, dtype_bytes: int) -> tuple[int, int]:
        """Nothing: the logits are locals of the step function, released when it returns; the p(x0) that ddpm_cache
        keeps is reused only by a step that runs no forward."""
        return 0, 0

    def run(self, runner: Any, ids: Tensor, am: Tensor, model: Any, s: MDLMSettings,
            generator: torch.Generator | None, bar: Any) -> tuple[Tensor, Tensor, TrajectoryRecorder]:
        mask_id, batch = model.cfg.mask_token_id, ids.shape[0]
        x, prompt, recorder = masked_canvas(ids, s.gen_length, mask_id)
        n = self.plan(s).n_steps
        ts, dt, cache = torch.linspace(1, s.eps, s.steps + 1), (1 - s.eps) / s.steps, None
        step = self._analytic_step if s.predictor == "analytic" else self._ddpm_step
        for i in range(s.steps):
            x_new, cache = step(runner, i, n, x, prompt, ts[i] * torch.ones(batch), dt, cache, s, model, generator)
            commit(runner, recorder, i, x, x_new)
            x = x_new
            if bar is not None:
                bar.update(1)
        if s.noise_removal and s.predictor == "analytic":
            x = self._denoiser_final(runner, x, prompt, s, model, generator, recorder)
        elif s.noise_removal:
            x = _greedy_final(self, runner, x, prompt, s.steps, s.eps, loglinear_sigma, mask_id, recorder)
        warn_masked_answer(x, ids.shape[1], model, self.name)
        return x, _full_mask(am, x), recorder

    def _log_p(self, runner: Any, i: int, n: int, x: Tensor, prompt: Tensor, t: Tensor, mask_id: int) -> Tensor:
        from mdm_lens.ddit.outputs import subs

        return subs(self.forward(runner, i, n, x, prompt, t, loglinear_sigma(t), mask_id), x, mask_id)

    def _ddpm_step(self, runner: Any, i: int, n: int, x: Tensor, prompt: Tensor, t: Tensor, dt: float,
                   cache: Tensor | None, s: MDLMSettings, model: Any, generator: Any) -> tuple[Tensor, Tensor | None]:
        mask_id = model.cfg.mask_token_id
        if s.predictor == "ddpm_cache":
            mc_t, mc_s = t, t - dt
        else:  # _ddpm_update: move chances 1 − e^{−σ} from the schedule, i.e. (1 − eps)·t
            mc_t, mc_s = 1 - torch.exp(-loglinear_sigma(t)), 1 - torch.exp(-loglinear_sigma(t - dt))
        p_x0 = cache if cache is not None else self._log_p(runner, i, n, x, prompt, t, mask_id).exp()
        q = p_x0 * (mc_t - mc_s).to(x.device)[:, None, None]
        q[:, :, mask_id] = mc_s.to(x.device)[:, None]
        x_new = torch.where(x != mask_id, x, sample_categorical(q, generator))
        reuse = s.predictor == "ddpm_cache" and torch.allclose(x_new, x) and not model.cfg.extra["time_conditioning"]
        return x_new, (p_x0 if reuse else None)

    def _analytic_step(self, runner: Any, i: int, n: int, x: Tensor, prompt: Tensor, t: Tensor, dt: float,
                       cache: Any, s: MDLMSettings, model: Any, generator: Any) -> tuple[Tensor, None]:
        from mdm_lens.diffusion.mdlm_analytic import analytic_probs

        mask_id = model.cfg.mask_token_id
        sigma_t, sigma_s = loglinear_sigma(t), loglinear_sigma(t - dt)
        log_p = self._log_p(runner, i, n, x, prompt, t, mask_id)
        probs = analytic_probs(log_p, x, sigma_t.to(x.device), (sigma_t - sigma_s).to(x.device), mask_id)
        return sample_categorical(probs, generator), None

    def _denoiser_final(self, runner: Any, x: Tensor, prompt: Tensor, s: MDLMSettings, model: Any, generator: Any,
                        recorder: TrajectoryRecorder) -> Tensor:
        from mdm_lens.diffusion.mdlm_analytic import denoiser_probs

        mask_id, t = model.cfg.mask_token_id, torch.full((x.shape[0],), s.eps)
        log_p = self._log_p(runner, s.steps, s.steps + 1, x, prompt, t, mask_id)
        x_new = sample_categorical(denoiser_probs(log_p, x, loglinear_sigma(t).to(x.device), mask_id), generator)
        commit(runner, recorder, s.steps, x, x_new)
        return x_new


register(MDLMSampler())


def duo_alpha(t: Tensor) -> Tensor:
    return 1 - (1 - NOISE_EPS) * t


def duo_posterior(x: Tensor, x0: Tensor, alpha_t: Tensor, alpha_s: Tensor) -> Tensor:
    """ch-1 `_compute_posterior`: q(x_s | x_t, x̂0) of uniform-state diffusion, [batch, pos, vocab]."""
    V = x0.shape[-1]
    a_t, a_s = alpha_t[:, None, None].to(x0.dtype), alpha_s[:, None, None].to(x0.dtype)
    e_x = torch.nn.functional.one_hot(x, V).to(x0.dtype)
    x0_at_x = x0.gather(-1, x[..., None])
    num = a_t * V * x0 * e_x + (a_t / a_s - a_t) * e_x + (a_s - a_t) * x0 + (1 - a_t / a_s) * (1 - a_s) / V
    return num / (a_t * V * x0_at_x + (1 - a_t))


def top_p_filter(logits: Tensor, top_p: float) -> Tensor:
    """Nucleus filtering of log-values: keep the smallest prefix (by descending value) whose softmax mass reaches
    top_p (the token crossing it kept), the rest −inf."""
    sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cum > top_p
    remove[..., 1:] = remove[..., :-1].clone()
    remove[..., 0] = False
    return logits.masked_fill(remove.scatter(-1, idx, remove), float("-inf"))


@dataclass
class DuoSettings(DDiTSettings):
    """ch-1 `generate_samples`: ancestral predictor, steps 1000, noise_removal "ancestral", use_float64 True,
    p_nucleus 1.0 (the HF example for duo-distilled: steps=8, noise_removal="greedy")."""

    steps: int | None = 1000
    noise_removal: str | None = "ancestral"
    use_float64: bool = True
    p_nucleus: float = 1.0

    def resolve(self, model: Any) -> "DuoSettings":
        return dataclasses.replace(self, **self.checked(
            model, use_float64=validate.boolean(self.use_float64, name="use_float64"),
            noise_removal=validate.choice(self.noise_removal, ("ancestral", "greedy", None), name="noise_removal",
                                          error=SamplerConfigError),
            p_nucleus=R.apply(self, "p_nucleus")))


DuoSettings.rules = {**CanvasSettings.rules, "eps": EPS_RULE, "use_float64": R.boolean(),
                     "noise_removal": R.choice(("ancestral", "greedy"), none=True),
                     "p_nucleus": R.number(0, 1, low_open=True)}  # a nucleus of mass 0 keeps no token


class DuoSampler(DDiTSampler):
    name, Settings, family = "duo", DuoSettings, "duo"
    neutral = dict(p_nucleus=1.0)

    def check_model(self, model: Any) -> None:
        if model.cfg.family != "duo":
            raise SamplerConfigError(f"sampler='duo' runs Duo checkpoints; this model is {model.cfg.family!r}.",
                                     argument="sampler", value=self.name, allowed="a duo model")

    def _check_prompt(self, model: Any, ids: Tensor, gen_length: int) -> None:
        # uniform-state: no mask token to refuse in the prompt; only the length is checked
        if ids.shape[1] + gen_length > model.cfg.n_ctx:
            raise SamplerConfigError(f"prompt ({ids.shape[1]}) + gen_length ({gen_length}) exceeds the model length "
                                     f"{model.cfg.n_ctx}.", argument="gen_length", value=gen_length,
                                     allowed=f"<= {model.cfg.n_ctx - ids.shape[1]}")

    def run(self, runner: Any, ids: Tensor, am: Tensor, model: Any, s: DuoSettings,
            generator: torch.Generator | None, bar: Any) -> tuple[Tensor, Tensor, TrajectoryRecorder]:
        (batch, p_len), V = ids.shape, model.cfg.d_vocab
        x = torch.cat([ids, torch.randint(0, V, (batch, s.gen_length), generator=generator).to(ids.device)], dim=1)
        prompt = torch.zeros_like(x, dtype=torch.bool)
        prompt[:, :p_len] = True
        recorder = TrajectoryRecorder(batch, x.shape[1], p_len, x.device)
        n = self.plan(s).n_steps
        ts, dt = torch.linspace(1, s.eps, s.steps + 1), (1 - s.eps) / s.steps
        sigma_of = self.sigma_of  # σ = −log α_t
        for i in range(s.steps + (1 if s.noise_removal == "ancestral" else 0)):
            last = i == s.steps  # the ancestral noise removal: the same update to α_s = 1
            t = (ts[-1] if last else ts[i]) * torch.ones(batch)
            alpha_t = duo_alpha(t)
            alpha_s = torch.ones(batch) if last else duo_alpha(t - dt)
            logits = self.forward(runner, i, n, x, prompt, t, sigma_of(t), None)
            x0 = torch.log_softmax(logits, dim=-1).exp()
            x0 = x0.to(torch.float64) if s.use_float64 else x0
            q = duo_posterior(x, x0, alpha_t.to(x.device), alpha_s.to(x.device))
            if s.p_nucleus < 1:  # ch-1 filters log q and feeds the log-values to the Gumbel draw (reference bug)
                q = top_p_filter(q.log(), s.p_nucleus)
            x_new = torch.where(prompt, x, sample_categorical(q, generator))
            commit(runner, recorder, i, x, x_new)
            x = x_new
            if bar is not None:
                bar.update(1)
        if s.noise_removal == "greedy":
            x = _greedy_final(self, runner, x, prompt, s.steps, s.eps, sigma_of, None, recorder)
        return x, _full_mask(am, x), recorder

    def plan(self, s: Any) -> Plan:
        return Plan(s.steps + (1 if s.noise_removal is not None else 0))

    def sigma_of(self, t: Tensor) -> Tensor:
        return -torch.log(duo_alpha(t))


register(DuoSampler())
