"""DreamOn's variable-length infilling sampler (`DreamLM/DreamOn@8a0a5491 eval/generator.py::MDMGenerator.
batch_generate_with_expand_as_token`, families-2.md §8.1), step by step and observable.

The canvas is `prompt + [MASK] × min_gen_len + suffix + [EOS]`. Each step commits exactly ONE masked token (the
most confident by `alg`, or one drawn from softmax(confidence / alg_temp)); committing the expand token replaces
that row by two masks (the span grows by one, at most `max_gen_len` times and up to `max_tokens` rows); committing
EOS inside the span fills every later step-start mask with EOS (`pad_eos_to_right`) and every EOS at a step-start
mask position is then removed (`delete_eos_token`: the span shrinks). The run stops when the span holds no mask.

Exactness notes. The reference forwards its whole `max_tokens` buffer with a pair mask hiding the rows past the
current window and positions `0..W-1` inside it; the window's logits depend only on the window, so this sampler
forwards the window alone (same logits, and hooks see only rows that exist). Its random draws (token sampling at
temperature > 0, the `alg_temp` draw) come from the seeded generator in the order the reference makes them. Its
quirks are kept: the delete pass uses the step-start mask positions even after an expansion shifted the rows, and
the EOS fill starts at the first EOS anywhere in the canvas (an EOS in the prompt fills the whole span).

Rows move, so the run is variable-length (`mdm_lens.diffusion.varlen`): `model.state.slot` / `.origin` name each
row, `out.trajectory.length` keeps the slot map of every step, and `out.answer_length` is the final span length."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mdm_lens import tokenization, validate
from mdm_lens.diffusion import arguments
from mdm_lens.diffusion import rules as R
from mdm_lens.diffusion.noise import sample_tokens
from mdm_lens.diffusion.output import GenerateOutput, model_key
from mdm_lens.diffusion.registry import Observation, Sampler, SamplerSettings, progress_bar, register, resolved
from mdm_lens.diffusion.state import DenoisingState
from mdm_lens.diffusion.varlen import LengthRecorder, Slots
from mdm_lens.errors import InputError, SamplerConfigError
from mdm_lens.hooks.runner import StepRunner

ALGORITHMS = ("maskgit_plus", "topk_margin", "entropy")  # the reference raises NotImplementedError on "origin"
EXPAND_TOKEN = "<|expand|>"


@dataclass
class DreamOnSettings(SamplerSettings):
    """Defaults: the reference's `eval/configs/eval_infill.yaml` (steps 128, gen lengths 4..64, entropy, T 0.1,
    top-p 0.9) and `MDMGeneratorArgs.max_tokens` 2048. `suffix`: the text (needs a tokenizer) or token ids after
    the span; the EOS that closes the canvas is appended, as the reference's `encode(suffix, add_eos=True)`."""

    suffix: Any = ()
    steps: int = 128
    min_gen_len: int = 4
    max_gen_len: int = 64
    max_tokens: int = 2048
    alg: str = "entropy"
    alg_temp: float | None = 0.0
    temperature: float = 0.1
    top_p: float | None = 0.9
    top_k: int | None = None
    delete_eos_token: bool = True
    pad_eos_to_right: bool = True
    expand_id: int | None = resolved()
    eos_id: int | None = resolved()

    def resolve(self, model: Any) -> "DreamOnSettings":
        if self.max_gen_len < self.min_gen_len:
            raise SamplerConfigError(f"max_gen_len={self.max_gen_len} < min_gen_len={self.min_gen_len}: the span starts "
                                     "at min_gen_len masks and grows up to max_gen_len.", argument="max_gen_len",
                                     value=self.max_gen_len, allowed=f">= min_gen_len ({self.min_gen_len})")
        expand, eos = expand_token_id(model), _eos(model)
        validate.distinct_ids({"expand_token_id": expand, "delete/EOS id": eos, "cfg.mask_token_id":
                               model.cfg.mask_token_id}, error=SamplerConfigError,
                              why="DreamOn grows the span at the expand id, deletes and closes at the EOS, and fills "
                                  "masks, so the three must differ (cfg.extra['expand_token_id'], "
                                  "cfg.extra['delete_token_id'] else cfg.eos_token_id).")
        return dataclasses.replace(self, expand_id=expand, eos_id=eos)


DreamOnSettings.rules = {
    "suffix": R.anything("text (with a tokenizer) or a 1-D list / tensor of token ids"),
    "steps": R.integer(1), "min_gen_len": R.integer(1), "max_gen_len": R.integer(1), "max_tokens": R.integer(2),
    "alg": R.choice(ALGORITHMS), "alg_temp": R.number(0, none=True), "temperature": R.number(0),
    "top_p": R.number(0, 1, none=True, low_open=True), "top_k": R.integer(1, none=True),
    "delete_eos_token": R.boolean(), "pad_eos_to_right": R.boolean(),
}


def expand_token_id(model: Any) -> int:
    """The expand control token: `cfg.extra["expand_token_id"]` (the loader reads `<|expand|>` from the
    tokenizer files), else the attached tokenizer's `<|expand|>`; refused when neither has it."""
    i = model.cfg.extra.get("expand_token_id")
    tok = getattr(model, "tokenizer", None)
    if i is None and tok is not None:
        i = tokenization.token_to_id(tok, EXPAND_TOKEN)
    if i is None:
        raise SamplerConfigError(f"sampler 'dreamon' needs the expand token, and {model.cfg.model_name!r} has none: "
                                 f"cfg.extra['expand_token_id'] is unset and no {EXPAND_TOKEN!r} is in its tokenizer "
                                 "(DreamOn-v0-7B: 151667). Set model.cfg.extra['expand_token_id'].",
                                 argument="expand_token_id", value=None, allowed="a token id in the vocabulary")
    return validate.integer(i, name="cfg.extra['expand_token_id']", min=0, max=model.cfg.d_vocab - 1,
                            error=SamplerConfigError)


def _eos(model: Any) -> int:
    """The tokenizer's EOS, which deletes and closes the canvas: `cfg.extra["delete_token_id"]` (the loader reads
    it from a DreamOn checkpoint's tokenizer files, mdm_lens.loading.dreamon), else `cfg.eos_token_id`."""
    if model.cfg.extra.get("delete_token_id") is not None:
        return validate.integer(model.cfg.extra["delete_token_id"], name="cfg.extra['delete_token_id']", min=0,
                                max=model.cfg.d_vocab - 1, error=SamplerConfigError)
    if model.cfg.eos_token_id is None:
        raise SamplerConfigError("sampler 'dreamon' deletes at EOS and closes the canvas with it; this model has no "
                                 "cfg.eos_token_id.", argument="eos_token_id", value=None, allowed="a token id")
    return int(model.cfg.eos_token_id)


def dreamon_sample(runner: Any, inp: Tensor, s: DreamOnSettings, mask: int, generator: torch.Generator | None,
                   bar: Any = None) -> tuple[Tensor, int, LengthRecorder]:
    """The loop (module docstring) on a `[1, L]` canvas; returns the final window, the span length, the trace."""
    length, dev = inp.shape[1], inp.device
    max_tokens = min(s.max_tokens, length + s.max_gen_len - s.min_gen_len)
    x = torch.nn.functional.pad(inp, (0, max_tokens - length), value=mask)  # the reference's buffer
    slots = Slots(inp != mask)  # slots follow the window only: the buffer's tail is masks that never enter it
    recorder = LengthRecorder(slots, max_tokens)
    ngen, budget = s.min_gen_len, s.max_gen_len
    for i in range(s.steps):
        width = length - s.min_gen_len + ngen
        window = x[:, :width]
        masked = window == mask
        if not bool(masked.any()):
            break
        state = DenoisingState(i, s.steps, 0, 1, window.clone(), masked, slots.prompt(dev),
                               torch.ones_like(masked), slot=slots.ids.to(dev), n_original=slots.n_original)
        recorder.step(state)
        logits = runner.forward(state, window)[masked]
        if width == max_tokens or budget == 0:  # no room or no budget left: the expand token is blocked
            logits[:, s.expand_id] -= 1e9
        new, chosen, conf = _commit_one(window, masked, logits, s, mask, generator)
        _finish_step(runner, recorder, state, new, chosen, conf, mask, i)
        x = torch.cat([new, x[:, width:]], dim=1)
        x, ngen, budget = _expand(x, slots, recorder, s.expand_id, mask, max_tokens, ngen, budget, i)
        if s.delete_eos_token:
            stale = torch.nn.functional.pad(masked, (0, max_tokens - width))  # step-start masks (a reference quirk)
            x, ngen = _delete(x, stale, slots, recorder, s.eos_id, mask, ngen, i)
        if bar is not None:
            bar.update(1)
    return x[:, :length - s.min_gen_len + ngen], ngen, recorder


def _commit_one(window: Tensor, masked: Tensor, logits: Tensor, s: DreamOnSettings, mask: int,
                generator: torch.Generator | None) -> tuple[Tensor, int, float]:
    """One token into the window (the chosen masked row, then the EOS fill); returns (canvas, row, confidence)."""
    conf, x0 = sample_tokens(logits, s.temperature, s.top_p, s.top_k, margin_confidence=s.alg == "topk_margin",
                             neg_entropy=s.alg == "entropy", generator=generator)
    if not s.alg_temp:
        j = int(torch.topk(conf, 1).indices[0])
    else:
        weights = torch.softmax(conf / s.alg_temp, dim=-1)
        j = int(torch.multinomial(weights.float().cpu(), 1, generator=generator)[0])
    rows = masked[0].nonzero().flatten()
    new = window.clone()
    new[0, rows[j]] = x0[j]
    if s.pad_eos_to_right:
        eos = (new[0] == s.eos_id).nonzero().flatten()
        if eos.numel():
            after = torch.arange(new.shape[1], device=new.device) >= int(eos[0])
            new[0, after & masked[0]] = s.eos_id
    return new, int(rows[j]), float(conf[j])


def _finish_step(runner: Any, recorder: LengthRecorder, state: DenoisingState, new: Tensor, chosen: int,
                 conf: float, mask: int, step: int) -> None:
    """Post-commit state for the reducers, and the commits (by slot) for the trajectory."""
    committed = state.masked & (new != mask)
    confidence = torch.full(new.shape, float("-inf"), device=new.device)
    confidence[0, chosen] = conf  # the EOS fill commits without a confidence of its own: NaN there
    confidence[committed & (torch.arange(new.shape[1], device=new.device) != chosen)[None]] = float("nan")
    state.confidence, state.committed = confidence, committed
    runner.end_step(state)
    for j in committed[0].nonzero().flatten().tolist():
        recorder.commit(step, int(state.slot[0, j]), int(new[0, j]), float(confidence[0, j]))


def _expand(x: Tensor, slots: Slots, recorder: LengthRecorder, expand_id: int, mask: int, max_tokens: int,
            ngen: int, budget: int, step: int) -> tuple[Tensor, int, int]:
    """Every expand token (right to left) → two masks; the buffer is cut back to max_tokens."""
    for idx in sorted((x[0] == expand_id).nonzero().flatten().tolist(), reverse=True):
        x = torch.cat([x[:, :idx], x.new_full((1, 2), mask), x[:, idx + 1:]], dim=1)[:, :max_tokens]
        gone = slots.delete(idx)
        slots.insert(idx, slots.new(2))
        recorder.remove(step, gone, "replaced")
        ngen, budget = ngen + 1, budget - 1
    return x, ngen, budget


def _delete(x: Tensor, stale: Tensor, slots: Slots, recorder: LengthRecorder, eos: int, mask: int, ngen: int,
            step: int) -> tuple[Tensor, int]:
    """Every EOS at a step-start mask position (right to left) is removed and a mask appended to the buffer."""
    for idx in sorted(((x[0] == eos) & stale[0]).nonzero().flatten().tolist(), reverse=True):
        x = torch.cat([x[:, :idx], x[:, idx + 1:], x.new_full((1, 1), mask)], dim=1)
        recorder.remove(step, slots.delete(idx), "deleted")
        ngen -= 1
    return x, ngen


class DreamOnSampler(Sampler):
    """`generate(model, prefix, sampler="dreamon", suffix=...)` on a Dream-family model with an expand token."""

    name, Settings = "dreamon", DreamOnSettings
    variable_length = True  # rows are inserted / deleted: consumers check it (varlen.refuse_variable_sampler)
    # do-nothing values, so one set of keywords may go to every sampler (registry.Sampler.neutral)
    neutral = dict(top_p=None, top_k=None, alg_temp=None)

    def check_model(self, model: Any) -> None:
        if not model.cfg.logit_shift or model.cfg.attention == "causal" or model.cfg.mask_token_id is None:
            raise SamplerConfigError(f"sampler 'dreamon' runs Dream-family models (bidirectional, shifted logits, a "
                                     f"mask token); {model.cfg.model_name!r} is not one.", argument="sampler",
                                     value=self.name, allowed="a Dream / DreamOn model")

    def canvas(self, model: Any, prompt: Any, s: DreamOnSettings, obs: Observation) -> tuple[Tensor, int]:
        ids, am = arguments.prompt_tokens(model, prompt, obs.attention_mask)
        arguments.one_unpadded_row(self.name, ids, am, "it infills one canvas; the reference requires batch 1")
        suffix = _suffix(model, s.suffix, ids.device)
        mask = model.cfg.mask_token_id
        inp = torch.cat([ids, ids.new_full((1, s.min_gen_len), mask), suffix, ids.new_full((1, 1), s.eos_id)], 1)
        bad = torch.cat([ids, suffix], 1)
        for what, tok in (("mask", mask), ("expand", s.expand_id)):
            if bool((bad == tok).any()):
                raise InputError(f"the prompt / suffix contains the {what} token {tok}, which the sampler would "
                                 "decode or expand; remove it.", argument="prompt", value=tok,
                                 allowed=f"ids other than {mask} and {s.expand_id}")
        if s.max_tokens < inp.shape[1] or min(s.max_tokens, inp.shape[1] + s.max_gen_len - s.min_gen_len) > model.cfg.n_ctx:
            raise SamplerConfigError(f"max_tokens={s.max_tokens}: the canvas needs {inp.shape[1]} rows and may grow "
                                     f"to {inp.shape[1] + s.max_gen_len - s.min_gen_len}, within the model's "
                                     f"{model.cfg.n_ctx} positions.", argument="max_tokens", value=s.max_tokens,
                                     allowed=f">= {inp.shape[1]}, with the grown canvas <= n_ctx {model.cfg.n_ctx}")
        return inp, ids.shape[1]

    def check_inputs(self, model: Any, ids: Tensor, am: Tensor, s: DreamOnSettings, obs: Observation) -> None:
        self.canvas(model, ids, s, Observation(attention_mask=am))  # its checks build the canvas they check

    def generate(self, model: Any, prompt: Any, s: DreamOnSettings, obs: Observation) -> GenerateOutput:
        inp, prefix = self.canvas(model, prompt, s, obs)
        max_width = min(s.max_tokens, inp.shape[1] + s.max_gen_len - s.min_gen_len)
        runner = StepRunner(model, fwd_hooks=obs.fwd_hooks, hook_steps=obs.hook_steps, record=obs.record,
                            cache=obs.cache)
        runner.refuse_end_relative("DreamOn stops when its span holds no mask")
        runner.begin(1, max_width, s.steps, n_blocks=1, phases=("cond",))
        generator = torch.Generator().manual_seed(obs.seed) if obs.seed is not None else None
        bar = progress_bar(obs.progress, s.steps, "dreamon sampling")
        try:
            with torch.no_grad():
                x, ngen, recorder = dreamon_sample(runner, inp, s, model.cfg.mask_token_id, generator, bar)
        finally:
            if bar is not None:
                bar.close()
        trajectory = recorder.finish(x)
        runner.warn_unreached(trajectory.n_steps)
        # Too few steps leave masks in the span; warn as the block samplers (InDel, LLaDA2) do.
        arguments.warn_masked(x, prefix, [ngen], model.cfg.mask_token_id, self.name)
        records, meta = runner.records()
        texts = None
        if model.tokenizer is not None:
            texts = [tokenization.decode(model.tokenizer, x[0, prefix:prefix + ngen].tolist())]
        settings = dict(s.as_dict(), seed=obs.seed, mask_id=model.cfg.mask_token_id)
        return GenerateOutput(tokens=x, prompt_length=prefix, attention_mask=torch.ones_like(x),
                              trajectory=trajectory, sampler=self.name, settings=settings, causal=False,
                              records=records, record_meta=meta, cache=runner.cache, model_name=model.cfg.model_name,
                              texts=texts, model_key=model_key(model), answer_length=[ngen])


def _suffix(model: Any, suffix: Any, device: torch.device) -> Tensor:
    if isinstance(suffix, str):
        if model.tokenizer is None:
            raise InputError("suffix given as text, but the model has no tokenizer: pass token ids.",
                             argument="suffix", value=suffix, allowed="token ids")
        suffix = tokenization.encode(model.tokenizer, suffix)
    try:
        t = torch.as_tensor(suffix if not isinstance(suffix, Tensor) else suffix.cpu())
    except (TypeError, ValueError, RuntimeError):
        t = torch.zeros(0, 0)
    if t.numel() == 0 and t.ndim == 1:
        t = t.long()
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise InputError(f"suffix={validate.describe(suffix)}: expected integer token ids.", argument="suffix",
                         value=suffix, allowed="a 1-D list / tensor of int ids")
    if t.ndim == 2 and t.shape[0] == 1:
        t = t[0]
    if t.ndim != 1:
        raise InputError(f"suffix={validate.describe(suffix)}: expected a 1-D sequence of token ids.",
                         argument="suffix", value=suffix, allowed="a 1-D list / tensor of ids")
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= model.cfg.d_vocab):
        raise InputError(f"suffix holds ids outside [0, {model.cfg.d_vocab}).", argument="suffix", value=suffix,
                         allowed=f"ids in [0, {model.cfg.d_vocab})")
    return t[None].to(device)


register(DreamOnSampler())
