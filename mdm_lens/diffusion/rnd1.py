"""RND1's `diffusion_sample` (RadicalNumerics/RND1 @ 87d5f465 `rnd/sampling.py`, called by `RND1LM.generate(inputs)`),
step by step and observable. Spec: families-2.md §6.5–§6.6.

Canvas (prefix mode, what `generate(inputs)` runs): the prompt, then `gen_length − 1` masks, then one slot reserved
for EOS that holds PAD (visible to attention) unless `add_eos_at_end`. Scores per position from the model's shifted
logits (position i reads hidden state i−1): tempered (`max(T, 1e-8)`), top-k then top-p filtered, log-softmax;
the prediction is the argmax (`greedy`) or a categorical draw; confidence = its log-probability; entropy of the
filtered distribution. Schedule over `steps`: for step = steps−1 … 1 keep the ⌊total·step/steps⌋ highest-entropy
maskable positions masked and commit every other one; with `eb_gamma`, instead commit the most confident positions
while their summed entropy minus the largest one stays ≤ γ; the last forward fills what remains. The loop
re-scores only while something is maskable, so a run can end before `steps` forwards.

Differences, documented: batch 1 only (the reference builds a `(1, seq_len)` canvas); the reference's categorical
draw uses the global RNG, ours the run's seeded generator with the same `torch.multinomial` call (same stream for the
same seed); `eos_token_id` / `pad_token_id` default to the model's (the reference's `or` chain would also skip an id
of 0, a quirk not reproduced: 0 is a valid id here)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from mdm_lens import validate
from mdm_lens.diffusion import arguments
from mdm_lens.diffusion import rules as R
from mdm_lens.diffusion.canvas import CanvasSampler, CanvasSettings, Plan
from mdm_lens.diffusion.output import TrajectoryRecorder
from mdm_lens.diffusion.registry import DEFAULT, register
from mdm_lens.diffusion.state import DenoisingState
from mdm_lens.errors import SamplerConfigError


def top_k_filter(logits: Tensor, k: int) -> Tensor:
    """Every logit outside the k largest becomes −inf (RND1's `apply_top_k_filtering`)."""
    values, index = torch.topk(logits, min(k, logits.shape[-1]), dim=-1)
    return torch.full_like(logits, float("-inf")).scatter_(-1, index, values)


def top_p_filter(logits: Tensor, p: float) -> Tensor:
    """Nucleus filter keeping the token that crosses `p` (−inf elsewhere, RND1's `apply_top_p_filtering`)."""
    ordered, index = torch.sort(logits, descending=True, dim=-1)
    drop = torch.cumsum(torch.softmax(ordered, dim=-1), dim=-1) > p
    drop[..., 0] = False
    drop[..., 1:] = drop[..., :-1].clone()
    return logits.masked_fill(drop.scatter(-1, index, drop), float("-inf"))


def rnd1_scores(aligned: Float[Tensor, "batch pos vocab"], x: Int[Tensor, "batch pos"], *, temperature: float,
                top_k: int | None, top_p: float | None, greedy: bool, generator: torch.Generator | None
                ) -> tuple[Tensor, Tensor, Tensor]:
    """(prediction, confidence, entropy) per position; position 0 predicts its own token with the lowest
    confidence and entropy 0 (no hidden state before it).

    The reference scores the *unshifted* rows (row j predicts token j+1) and shifts afterwards, so its categorical
    draw consumes the random stream in that row order: the rows are put back in that order here (row j =
    aligned j+1; the last row, whose prediction is discarded, is a stand-in) before the draw, then shifted."""
    rows = torch.cat([aligned[:, 1:], aligned[:, :1]], dim=1)
    logits = rows / max(temperature, 1e-8)
    if top_k is not None and top_k > 0:
        logits = top_k_filter(logits, top_k)
    if top_p is not None and 0 < top_p < 1:
        logits = top_p_filter(logits, top_p)
    logp = torch.log_softmax(logits, dim=-1)
    if greedy:
        nxt = logp.argmax(-1)
    else:  # what Categorical(logits=logp).sample() runs (one uniform per row, in row order), on the run's generator
        probs = torch.distributions.Categorical(logits=logp).probs.reshape(-1, logp.shape[-1])
        nxt = torch.multinomial(probs.cpu(), 1, True, generator=generator).reshape(x.shape).to(x.device)
    conf_next = logp.gather(-1, nxt[..., None]).squeeze(-1)
    ent_next = -(logp.exp() * logp).sum(-1)
    pred = x.clone()
    conf = torch.full_like(conf_next, torch.finfo(conf_next.dtype).min)
    ent = torch.zeros_like(ent_next)
    pred[:, 1:], conf[:, 1:], ent[:, 1:] = nxt[:, :-1], conf_next[:, :-1], ent_next[:, :-1]
    return pred, conf, ent


def keep_by_entropy(ent: Tensor, maskable: Bool[Tensor, "batch pos"], keep: int) -> Tensor:
    """The `keep` highest-entropy maskable positions (they stay masked this step)."""
    kept = torch.zeros_like(maskable)
    if keep > 0:
        scores = ent.masked_fill(~maskable, -torch.finfo(ent.dtype).max)
        kept[0, torch.topk(scores, keep, dim=-1).indices[0]] = True
    return kept


def entropy_bounded(conf: Tensor, ent: Tensor, maskable: Tensor, gamma: float) -> Tensor:
    """The most confident maskable positions whose summed entropy minus the largest stays within `gamma`."""
    err = (-conf).masked_fill(~maskable, torch.finfo(conf.dtype).max)
    order = torch.sort(err, dim=-1).indices
    ranked = ent.gather(1, order)
    n = int(((ranked.cumsum(-1) - ranked.cummax(-1).values) <= gamma).sum())
    chosen = torch.zeros_like(maskable)
    chosen[0, order[0, :n]] = True
    return chosen & maskable


def rnd1_canvas(ids: Tensor, gen_length: int, *, mask_id: int, pad_id: int, eos_id: int, bos_id: int | None,
                add_eos_at_end: bool) -> tuple[Tensor, Tensor]:
    """(canvas, maskable): prompt, `gen_length − 1` masks, the reserved EOS slot (PAD, or EOS)."""
    x = torch.full((1, ids.shape[1] + gen_length), pad_id, dtype=ids.dtype, device=ids.device)
    if add_eos_at_end:
        x[0, -1] = eos_id
    x[0, :ids.shape[1]] = ids[0]
    x[0, ids.shape[1]:-1] = mask_id
    maskable = torch.zeros_like(x, dtype=torch.bool)
    maskable[0, ids.shape[1]:-1] = True
    if bos_id is not None:
        maskable[:, 0] = False
    return x, maskable & (x != eos_id) & (x != pad_id)


def scheduled_keep(total: int, step: int, steps: int) -> int:
    """How many maskable positions stay masked after schedule step `step` (counted down from steps−1)."""
    # the reference multiplies a long tensor by a Python float: a float32 product, then truncation
    return int((torch.tensor(total) * (step / steps)).long())


def rnd1_sample(runner: Any, x: Tensor, maskable: Tensor, prompt_length: int, *, steps: int, temperature: float,
                top_k: int | None, top_p: float | None, greedy: bool, eb_gamma: float | None,
                generator: torch.Generator | None, progress: Any = None) -> tuple[Tensor, TrajectoryRecorder]:
    recorder = TrajectoryRecorder(1, x.shape[1], prompt_length, x.device)
    # positions never maskable (the reserved EOS/PAD slot) are fixed input like the prompt: commit step -1
    recorder.commit_step[~maskable & (torch.arange(x.shape[1]) >= prompt_length)[None].to(maskable.device)] = -1
    prompt = torch.zeros_like(maskable)
    prompt[:, :prompt_length] = True
    visible = torch.ones_like(maskable)
    total = int(maskable.sum())
    for k in range(steps):
        state = DenoisingState(k, steps, 0, 1, x.clone(), maskable.clone(), prompt, visible)
        aligned = runner.forward(state, x)
        pred, conf, ent = rnd1_scores(aligned, x, temperature=temperature, top_k=top_k, top_p=top_p, greedy=greedy,
                                      generator=generator)
        step = steps - 1 - k
        if step == 0:
            commit = maskable.clone()
        elif eb_gamma is not None:
            commit = entropy_bounded(conf, ent, maskable, eb_gamma)
        else:
            keep = scheduled_keep(total, step, steps)
            commit = maskable & ~keep_by_entropy(ent, maskable, keep)
        x = torch.where(commit, pred, x)
        maskable = maskable & ~commit
        state.confidence = conf.float().masked_fill(~state.masked, float("nan"))
        state.committed = commit
        runner.end_step(state)
        recorder.record(k, 0, state.x, commit, state.confidence)
        if progress is not None:
            progress.update(1)
        if not bool(maskable.any()):
            break
    return x, recorder


@dataclass
class RND1Settings(CanvasSettings):
    """`RND1GenerationConfig`'s defaults: temperature 0.1, stochastic (`greedy=False`), no top-k / top-p, the
    entropy schedule (`eb_gamma=None`), no forced EOS. `gen_length` is `max_new_tokens` (its last slot is the
    reserved EOS slot); `steps` (`num_diffusion_steps`, 256 there) defaults to gen_length as in the README's demo
    (256 / 256). `eos_token_id` / `pad_token_id` default to the model's."""

    temperature: float = 0.1
    top_k: int | None = None
    top_p: float | None = None
    greedy: bool = False
    eb_gamma: float | None = None
    add_eos_at_end: bool = False
    eos_token_id: int | None = DEFAULT
    pad_token_id: int | None = DEFAULT

    def resolve(self, model: Any) -> "RND1Settings":
        lengths = self.lengths(model)
        if lengths["gen_length"] < 2:
            raise SamplerConfigError(f"gen_length={lengths['gen_length']} leaves no position to generate: RND1 "
                                     "reserves the last slot for EOS.", argument="gen_length",
                                     value=lengths["gen_length"], allowed="an int >= 2")
        ids = {}
        for name in ("eos_token_id", "pad_token_id"):
            value = getattr(model.cfg, name) if getattr(self, name) is DEFAULT else getattr(self, name)
            if value is None:
                raise SamplerConfigError(f"{name} is unknown for this model (cfg.{name} is None); pass {name}=.",
                                         argument=name, value=None, allowed="a token id")
            ids[name] = validate.integer(value, name=name, min=0, max=model.cfg.d_vocab - 1, error=SamplerConfigError)
        # EOS and pad positions are frozen (not maskable): either equal to the mask id freezes the whole answer.
        validate.distinct_ids({"mask_token_id": model.cfg.mask_token_id, "eos_token_id": ids["eos_token_id"]},
                              error=SamplerConfigError, why="RND1 never unmasks a position holding the EOS id, so "
                              "no position would be maskable.")
        validate.distinct_ids({"mask_token_id": model.cfg.mask_token_id, "pad_token_id": ids["pad_token_id"]},
                              error=SamplerConfigError, why="pad_token_id equals the mask id: no position would be "
                              "maskable.")
        return dataclasses.replace(self, **lengths, **ids, temperature=self.temperature_or(0.1))


RND1Settings.rules = {
    **CanvasSettings.rules, "temperature": R.number(0, none=True), "top_k": R.integer(1, none=True),
    "top_p": R.number(0, 1, none=True, low_open=True), "greedy": R.boolean(), "eb_gamma": R.number(0, none=True),
    "add_eos_at_end": R.boolean(), "eos_token_id": R.anything("a token id of the vocabulary (checked by resolve)"),
    "pad_token_id": R.anything("a token id of the vocabulary (checked by resolve)"),
}


class RND1Sampler(CanvasSampler):
    name, Settings = "rnd1", RND1Settings
    neutral = dict(top_k=None, top_p=None, eb_gamma=None, add_eos_at_end=False)

    def plan(self, s: RND1Settings) -> Plan:
        return Plan(s.steps, adaptive="RND1 stops scoring once no position is maskable")

    def idle_steps(self, s: RND1Settings) -> list[int]:
        """The steps the entropy schedule leaves idle (its keep count does not fall: steps > gen_length), before
        the run stops at the first step that empties the canvas; `eb_gamma` commits at least one per step."""
        if s.eb_gamma is not None:
            return []
        left = total = s.gen_length - 1  # the reserved EOS slot is never maskable
        idle = []
        for k in range(s.steps):
            step = s.steps - 1 - k
            keep = scheduled_keep(total, step, s.steps) if step else 0
            if keep >= left:
                idle.append(k)
            left = min(left, keep)
            if left == 0:
                break
        return idle

    def logit_bytes(self, s: RND1Settings, dtype_bytes: int) -> int:
        """Per logit `rnd1_scores` allocates beside the aligned logits (profiled, fp32 and bf16): the reordered
        rows and their tempered copy with, at the larger of its two moments, either the log-softmax, its exp and
        their product (and for a draw, Categorical's normalised logits) or top-p's sorted values, int64 order,
        softmax and cumulative sum. No Gumbel noise is drawn: the generic fp64 figure does not apply."""
        b = dtype_bytes
        scoring = 5 * b + b * int(not s.greedy)
        nucleus = 5 * b + 8 if s.top_p is not None and 0 < s.top_p < 1 else 0
        return max(scoring, nucleus)

    def check_run(self, ids: Tensor, am: Tensor, s: RND1Settings, obs: Any) -> None:
        arguments.one_unpadded_row(self.name, ids, am, "its canvas is (1, seq_len)")

    def run(self, runner: Any, ids: Tensor, am: Tensor, model: Any, s: RND1Settings,
            generator: torch.Generator | None, bar: Any) -> tuple[Tensor, Tensor, TrajectoryRecorder]:
        x, maskable = rnd1_canvas(ids, s.gen_length, mask_id=model.cfg.mask_token_id, pad_id=s.pad_token_id,
                                  eos_id=s.eos_token_id, bos_id=model.cfg.bos_token_id,
                                  add_eos_at_end=s.add_eos_at_end)
        x, recorder = rnd1_sample(runner, x, maskable, ids.shape[1], steps=s.steps, temperature=s.temperature,
                                  top_k=s.top_k, top_p=s.top_p, greedy=s.greedy, eb_gamma=s.eb_gamma,
                                  generator=generator, progress=bar)
        return x, torch.ones_like(x), recorder


register(RND1Sampler())
