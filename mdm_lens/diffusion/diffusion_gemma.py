"""DiffusionGemma's sampler (transformers' `DiffusionGemmaGenerationMixin.generate`), step by step and
observable, token-exact with transformers' `generate` under the same seed and settings.

Per canvas (block of `canvas_length` tokens): one **encoder** pass writes the new tokens into the KV
cache (phase "encoder"); then up to `max_denoising_steps` **denoiser** passes (phase "cond") over a
canvas that starts as uniform noise (random token ids, no mask token): sample every position at the
step's temperature (linear schedule, `t_max` → `t_min`), accept the lowest-entropy samples while
Σ entropy − max entropy ≤ `entropy_bound`, renoise the rest with fresh random ids, feed the step's
logits back as self-conditioning, and stop early when the argmax canvas is stable and its mean
entropy is below `confidence_threshold`. The canvas's argmax is appended; EOS ends a row.

What "committed" and "accepted" mean here (read off transformers' `_denoising_step`): nothing is ever frozen
while a canvas is denoised. Every step resamples *every* canvas position; the entropy bound picks which samples
are **accepted**, i.e. kept in the next step's input (the others are renoised with fresh random ids), and that
choice is made afresh at every step (a position can be accepted, renoised, accepted again). The tokens the
canvas contributes are the argmax of the *last* step a row runs in that canvas (its budget's last step, or the
step at which adaptive stopping finishes the row, after which transformers holds that row's argmax). So:

* a position is **committed** exactly once: at that step (`trajectory.commit_step`, `state.committed` after the
  step, `trajectory.n_committed[s]` = the positions whose `commit_step == s`); `commit_confidence` is the
  probability of the committed argmax token at that step;
* `state.masked` is "not committed yet": the whole canvas of a row still denoising, nothing for a row that has
  finished (it stays True at step s exactly for positions with `commit_step >= s`), so
  `ReceivedAttention(query="masked")` averages over the canvas rows still being decided and
  `query="committed"` over the rows committed at that step;
* **accepted** is the per-step keep set: `state.extra["accepted"]` (after the step), `trajectory.accepted`
  `[step, batch, pos]`; `state.extra["noised"]` marks the positions holding fresh noise in this step's input
  (all of them at a canvas's first step), `state.extra["renoised"]` those renoised after it.

These per-position tensors cover the canvas (the decoder's queries, `[batch, canvas]`); keys are absolute
positions (prompt, earlier canvases, this canvas). `state.extra["canvas_start"]` is the canvas's first
absolute position.

Steps are numbered over the whole run (canvas after canvas); the run's length is not known in advance
(adaptive stopping), so `n_steps` is the budget `n_canvases × max_denoising_steps` and step indices
counted from the end ("last", -1) are refused while a stopping rule is on.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from torch import Tensor

from mdm_lens import tokenization
from mdm_lens.diffusion.arguments import prompt_tokens
from mdm_lens.diffusion.diffusion_gemma_settings import (  # noqa: F401  (their home before the split)
    GENERATION_SETTINGS, DiffusionGemmaSettings, prepare_settings)
from mdm_lens.diffusion.output import GenerateOutput, Trajectory, model_key
from mdm_lens.diffusion.registry import DEFAULT, Observation, Sampler, SamplerSettings, progress_bar, register
from mdm_lens.diffusion.state import DenoisingState
from mdm_lens.errors import InputError, SamplerConfigError
from mdm_lens.hooks.runner import StepRunner
from mdm_lens.hooks.steps import Steps



def _seeded_sampler(sampler_cls: type, generator: torch.Generator) -> type:
    class SeededEntropyBoundSampler(sampler_cls):  # type: ignore[misc, valid-type]
        """transformers' sampler, its random canvases drawn from our generator (the same stream as the
        global one after `torch.manual_seed(seed)`)."""

        def initialize_canvas(self, batch_size: int, device: torch.device) -> Tensor:
            return torch.randint(low=0, high=self.vocab_size, size=(batch_size, self.canvas_length), device=device,
                                 generator=generator)

    return SeededEntropyBoundSampler


def _check_vocab(ids: Tensor, d_vocab: int) -> None:
    """Token ids outside the vocabulary (transformers' embedding would fail with a bare IndexError)."""
    bad = (ids < 0) | (ids >= d_vocab)
    if bool(bad.any()):
        where = bad.nonzero()[0].tolist()
        raise InputError(f"prompt holds token id {int(ids[tuple(where)])} at [row {where[0]}, position {where[1]}] "
                         f"({int(bad.sum())} id(s) in all) outside the vocabulary [0, {d_vocab - 1}].",
                         argument="prompt", value=ids, allowed=f"token ids in [0, {d_vocab - 1}]")


def _run(runner: StepRunner, state: DenoisingState, fn: Any) -> Any:
    """One pass with exactly this state's hooks (the runner's selection), for the encoder pass."""
    model = runner.model
    if runner.unknown_length:  # as runner.forward: is_last is unknown while adaptive stopping is on
        state.extra.setdefault("unknown_length", runner.unknown_length)
    model.state = state
    try:
        with model.hooks(fwd_hooks=runner._hooks_for(state)):
            return fn()
    finally:
        model.state = None


class _Recorder:
    """The trajectory over the final sequence: per step the full input (earlier tokens + this canvas), the
    positions committed at that step (each exactly once, see the module docstring) and those accepted."""

    def __init__(self, batch: int, total: int, prompt_length: int):
        self.total = total
        self.x_steps: list[Tensor] = []
        self.n_committed: list[Tensor] = []
        self.accepted: list[Tensor] = []
        self.blocks: list[int] = []
        self.commit_step = torch.full((batch, total), -2, dtype=torch.long)
        self.commit_step[:, :prompt_length] = -1
        self.commit_confidence = torch.full((batch, total), float("nan"))

    def record(self, step: int, block: int, prefix: Tensor, canvas: Tensor, committed: Tensor, accepted: Tensor,
               confidence: Tensor) -> None:
        start, width = prefix.shape[1], canvas.shape[1]
        row = torch.full((canvas.shape[0], self.total), -1, dtype=torch.long)
        row[:, :start] = prefix.cpu()
        row[:, start: start + width] = canvas.cpu()
        self.x_steps.append(row)
        acc = torch.zeros((canvas.shape[0], self.total), dtype=torch.bool)
        acc[:, start: start + width] = accepted.cpu()
        self.accepted.append(acc)
        committed = committed.cpu()
        self.n_committed.append(committed.sum(-1))
        self.blocks.append(block)
        sl = slice(start, start + width)
        self.commit_step[:, sl] = torch.where(committed, step, self.commit_step[:, sl])
        self.commit_confidence[:, sl] = torch.where(committed, confidence.float().cpu(), self.commit_confidence[:, sl])

    def finish(self, length: int) -> Trajectory:
        return Trajectory(torch.stack(self.x_steps)[..., :length], self.commit_step[:, :length],
                          self.commit_confidence[:, :length], torch.stack(self.n_committed), torch.tensor(self.blocks),
                          accepted=torch.stack(self.accepted)[..., :length])


def _finish_records(records: dict[str, Tensor], meta: dict[str, dict], max_pos: int, length: int,
                    key_end: dict[int, int]) -> dict[str, Tensor]:
    """Position axes (last, sized for the step budget's sequence) are cut to the generated sequence (EOS may
    end early), and keys that do not exist yet at a step (later canvases) are NaN, not 0: the floating probes
    read NaN as "not a key here", so a canvas's received attention is never compared with absent keys."""
    out = {}
    for name, value in records.items():
        if value.shape[-1] == max_pos and value.is_floating_point():
            value = value[..., :length].clone()
            for row, step in enumerate(meta.get(name, {}).get("steps", [])):
                value[row, ..., key_end[step]:] = float("nan")
            meta.setdefault(name, {})["absent_keys"] = "nan"
        out[name] = value
    return out


def generate(model: Any, prompt: Any, *, attention_mask: Tensor | None = None, generation_config: Any = None,
             entropy_bound: float | None = None, fwd_hooks: Sequence[Any] = (), hook_steps: Any = None,
             record: Sequence[Any] = (), cache: Any = None, seed: int | None = 0, progress: bool | None = None,
             **settings: Any) -> GenerateOutput:
    """Run DiffusionGemma's sampler with hooks, reducers and a trajectory cache.

    Settings take transformers' names (`max_new_tokens`, `max_denoising_steps`, `t_min`, `t_max`,
    `sampler_config=EntropyBoundSamplerConfig(entropy_bound=…)` or the shortcut `entropy_bound=`,
    `stability_threshold`, `confidence_threshold`, `eos_token_id`, `pad_token_id`, `generation_config`) and
    transformers' defaults. `seed` seeds the canvas noise and the sampling (None: the global generator's state).
    """
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (EntropyBoundSampler,
                                                                                 EntropyBoundSamplerConfig)

    hf = model.hf
    if entropy_bound is not None:
        if "sampler_config" in settings:
            raise SamplerConfigError("pass entropy_bound= or sampler_config=, not both.")
        # by its rule first: transformers' own check lets NaN through (NaN changes which samples are accepted)
        bound = DiffusionGemmaSettings.rules["entropy_bound"].check(entropy_bound, "entropy_bound")
        settings["sampler_config"] = EntropyBoundSamplerConfig(entropy_bound=bound)
    gc = prepare_settings(hf, generation_config, model.cfg.d_vocab, **settings)
    ids, am = prompt_tokens(model, prompt, attention_mask)
    _check_vocab(ids, model.cfg.d_vocab)
    device = ids.device
    batch, cur_len = ids.shape
    prompt_length = cur_len
    max_length, max_new_tokens = hf._prepare_generated_length(gc, cur_len)
    if max_new_tokens < 1:  # transformers reads max_length (with max_new_tokens at 256) as the total length
        raise SamplerConfigError(f"max_length={gc.max_length} leaves no token to generate after the prompt of "
                                 f"{cur_len}.", argument="max_length", value=gc.max_length,
                                 allowed=f"an int > the prompt length {cur_len}, or None")
    canvas_len = hf.config.canvas_length
    n_canvases = math.ceil(max_new_tokens / canvas_len)
    n_steps = n_canvases * gc.max_denoising_steps
    max_pos = prompt_length + n_canvases * canvas_len
    if max_pos > model.cfg.n_ctx:
        raise SamplerConfigError(f"prompt ({prompt_length}) + {n_canvases} canvas(es) of {canvas_len} = {max_pos} "
                                 f"exceeds the context of {model.cfg.n_ctx}.")
    runner = StepRunner(model, fwd_hooks=fwd_hooks, hook_steps=hook_steps, record=record, cache=cache)
    adaptive = (gc.stability_threshold is not None and gc.confidence_threshold is not None) or (
        gc.eos_token_id is not None and n_canvases > 1)
    if adaptive:
        runner.refuse_end_relative("DiffusionGemma stops adaptively (turn stopping off with stability_threshold="
                                   "None, confidence_threshold=None, eos_token_id=None to use them)")
    runner.begin(batch, max_pos, n_steps, n_blocks=n_canvases, phases=("encoder", "cond"))  # before any compute

    generator = torch.Generator(device=device)
    if seed is not None:
        generator.manual_seed(seed)
    else:
        generator.set_state(torch.random.get_rng_state() if device.type == "cpu" else torch.cuda.get_rng_state(device))
    sampler = _seeded_sampler(EntropyBoundSampler, generator)(
        config=gc.sampler_config, canvas_length=canvas_len, vocab_size=model.cfg.d_vocab,
        max_denoising_steps=gc.max_denoising_steps)
    logits_processor = hf._prepare_logits_processor(gc, None)
    stopping = hf._prepare_ar_stopping_criteria(gc, None)
    diffusion_stopping = hf._prepare_diffusion_stopping_criteria(gc)
    kv_cache = hf._prepare_cache_for_generation(generation_config=gc, batch_size=batch, max_length=max_length)
    eos_tensor = torch.tensor(gc.eos_token_id, device=device) if gc.eos_token_id is not None else None
    encoder_position_ids = torch.arange(0, cur_len, dtype=torch.int32, device=device).unsqueeze(0)
    decoder_position_ids = torch.arange(cur_len, cur_len + canvas_len, dtype=torch.int32, device=device).unsqueeze(0)
    attn = am.bool()
    decoder_attention_mask = torch.nn.functional.pad(attn, (0, canvas_len), value=True)
    finished_sequences = torch.zeros(batch, dtype=torch.bool, device=device)
    forward_passes = torch.zeros(batch, dtype=torch.int, device=device)
    recorder = _Recorder(batch, max_pos, prompt_length)
    embed_dtype = hf.model.decoder.embed_tokens.weight.dtype
    seq, step = ids, 0
    key_end: dict[int, int] = {}  # step → one past the last key that exists at that step
    bar = progress_bar(progress, n_steps, "diffusion_gemma sampling")
    try:
        with torch.no_grad():
            for block in range(n_canvases):
                start = seq.shape[1]
                new_ids, enc_masks = hf._prepare_encoder_inputs(
                    input_ids=seq, attention_mask=attn, encoder_position_ids=encoder_position_ids, cache=kv_cache,
                    is_prefill=block == 0, canvas_length=canvas_len, batch_size=batch)
                enc_state = DenoisingState(step, n_steps, block, n_canvases, new_ids.clone(),
                                           torch.zeros_like(new_ids, dtype=torch.bool),
                                           torch.ones_like(new_ids, dtype=torch.bool),
                                           attn[:, -new_ids.shape[1]:].clone(), phase="encoder")  # type: ignore[arg-type]
                _run(runner, enc_state, lambda: model.encode(new_ids, kv_cache, attention_mask=enc_masks,
                                                             position_ids=encoder_position_ids))
                canvas = sampler.initialize_canvas(batch_size=batch, device=device)
                self_cond = None
                mask_mapping = hf.model.decoder.create_diffusion_decoder_attention_mask(
                    config=hf.config, inputs_embeds=canvas.unsqueeze(-1), cache=kv_cache,
                    decoder_attention_mask=decoder_attention_mask)
                finished = torch.zeros(batch, dtype=torch.bool, device=device)
                if diffusion_stopping is not None:
                    diffusion_stopping.reset()
                argmax_canvas = canvas
                accepted_prev = torch.zeros_like(canvas, dtype=torch.bool)
                committed_before = torch.zeros_like(canvas, dtype=torch.bool)
                for cur_step in reversed(range(1, gc.max_denoising_steps + 1)):
                    active = ~(finished | finished_sequences)
                    forward_passes += active
                    # masked = not committed yet (the module docstring); noised = fresh noise in this input
                    state = DenoisingState(step, n_steps, block, n_canvases, canvas.clone(), ~committed_before,
                                           torch.zeros_like(accepted_prev), torch.ones_like(accepted_prev),
                                           block_slice=slice(start, start + canvas_len))
                    state.extra.update(canvas_start=start, cur_step=cur_step, finished=finished.clone(),
                                       noised=~accepted_prev)
                    # this step's decoder call again (same cache, self-conditioning, mask): knockout's pre-pass
                    state.extra["rerun"] = (lambda c=canvas, sc=self_cond: model(
                        decoder_input_ids=c, self_conditioning_logits=sc, decoder_attention_mask=mask_mapping,
                        cache=kv_cache, decoder_position_ids=decoder_position_ids, return_type=None))
                    raw = runner.forward(state, None, decoder_input_ids=canvas, self_conditioning_logits=self_cond,
                                         decoder_attention_mask=mask_mapping, cache=kv_cache,
                                         decoder_position_ids=decoder_position_ids)
                    # transformers' `_denoising_step`, in its order (every draw from our generator)
                    t_step = torch.tensor(cur_step, device=device, dtype=torch.int32)
                    processed = logits_processor(seq, raw, cur_step=t_step)
                    probs = torch.softmax(processed, dim=-1, dtype=torch.float32)
                    denoised = torch.multinomial(probs.view(-1, model.cfg.d_vocab), num_samples=1,
                                                 generator=generator).squeeze(-1).view(batch, canvas_len)
                    new_argmax = torch.argmax(processed, dim=-1)
                    accepted = sampler.accept_canvas(canvas, denoised, processed, t_step).clone()
                    accepted_mask = sampler.accepted_token_mask
                    new_canvas = sampler.renoise_canvas(accepted, t_step).clone()
                    frozen = finished.clone()  # rows whose argmax transformers holds at this step
                    if diffusion_stopping is not None:
                        if finished.any():
                            new_argmax = torch.where(finished[:, None], argmax_canvas, new_argmax)
                            new_canvas = torch.where(finished[:, None], canvas, new_canvas)
                            processed = torch.where(finished[:, None, None], self_cond, processed)
                        finished = finished | diffusion_stopping(new_argmax, processed)
                    # observation: a frozen (finished) row keeps its canvas, so its acceptance too
                    accepted_now = torch.where(frozen[:, None], accepted_prev, accepted_mask)
                    # a row's argmax is final at the step it finishes, or at the canvas's last step
                    last = cur_step == 1
                    final = (finished | last)[:, None] & ~committed_before
                    entropy = torch.special.entr(probs).sum(-1)  # the entropy the sampler ranks by
                    state.committed, state.confidence = final, -entropy
                    state.extra.update(accepted=accepted_now, renoised=~accepted_now, denoiser_canvas=denoised,
                                       argmax_canvas=new_argmax,
                                       temperature=float(gc.t_min + (gc.t_max - gc.t_min) * cur_step
                                                         / gc.max_denoising_steps)
                                       if gc.t_min is not None and gc.t_max is not None else 1.0)
                    runner.end_step(state)
                    top = probs.max(-1).values  # the committed argmax token's probability
                    recorder.record(step, block, seq, state.x, final, accepted_now, top)
                    key_end[step] = start + canvas_len
                    self_cond = processed.to(embed_dtype)
                    canvas, argmax_canvas, accepted_prev = new_canvas, new_argmax, accepted_now
                    committed_before = committed_before | final
                    step += 1
                    if bar is not None:
                        bar.update(1)
                    if bool(finished.all()):
                        break
                seq = torch.cat([seq, argmax_canvas], dim=-1)
                seq, finished_sequences = hf._finalize_canvas(
                    input_ids=seq, finished_sequences=finished_sequences, generation_config=gc,
                    stopping_criteria=stopping, canvas_length=canvas_len, eos_tensor=eos_tensor)
                if bool(finished_sequences.all()):
                    break
                cur_len, decoder_attention_mask, attn, encoder_position_ids, decoder_position_ids = (
                    hf._prepare_kwargs_for_next_canvas(attention_mask=attn,
                                                       decoder_attention_mask=decoder_attention_mask,
                                                       decoder_position_ids=decoder_position_ids,
                                                       canvas_length=canvas_len, cur_len=cur_len))
    finally:
        if bar is not None:
            bar.close()
    length = seq.shape[1]
    records, meta = runner.records()
    texts = None
    if model.tokenizer is not None:
        texts = [tokenization.decode(model.tokenizer, row[prompt_length:].tolist()) for row in seq.cpu()]
    settings_out = dict(max_new_tokens=max_new_tokens, max_denoising_steps=gc.max_denoising_steps,
                        entropy_bound=gc.sampler_config.entropy_bound, t_min=gc.t_min, t_max=gc.t_max,
                        stability_threshold=gc.stability_threshold, confidence_threshold=gc.confidence_threshold,
                        canvas_length=canvas_len, canvases=(length - prompt_length) // canvas_len, seed=seed)
    full_am = torch.cat([am, am.new_ones((batch, length - prompt_length))], dim=1)
    out = GenerateOutput(tokens=seq, prompt_length=prompt_length, attention_mask=full_am,
                         trajectory=recorder.finish(length), sampler="diffusion_gemma", settings=settings_out,
                         causal=False, records=_finish_records(records, meta, max_pos, length, key_end),
                         record_meta=meta, cache=runner.cache,
                         model_name=model.cfg.model_name, texts=texts, model_key=model_key(model))
    out.tokens_per_forward = hf._compute_tokens_per_forward(seq, forward_passes, prompt_length, gc.pad_token_id)
    return out


class DiffusionGemmaSampler(Sampler):
    name, Settings = "diffusion_gemma", DiffusionGemmaSettings
    renamed = {"gen_length": "max_new_tokens", "steps": "max_denoising_steps", "temperature": "t_min / t_max"}
    # its canvas is noise, not masks, and each denoiser pass reads the canvas' encoder KV cache and the previous
    # pass's self-conditioning logits, neither of which the run keeps
    no_replay = ("each denoiser pass reads its canvas' encoder KV cache and the previous pass's self-conditioning "
                 "logits, which the run does not keep (and its canvas is noise, not masks, so there is no mask "
                 "state to rebuild).")

    def check_model(self, model: Any) -> None:
        if not getattr(model, "is_block_diffusion", False):
            raise SamplerConfigError(f"sampler='diffusion_gemma' needs a DiffusionGemma model (TransformersBridge); "
                                     f"{model.cfg.model_name} is {model.cfg.family}.", argument="sampler",
                                     value=self.name, allowed="a sampler of this model's family, or 'auto'")

    def generate(self, model: Any, prompt: Any, settings: SamplerSettings, obs: Observation) -> GenerateOutput:
        given = {k: v for k, v in settings.as_dict().items() if v is not DEFAULT}  # unset: transformers resolves
        return generate(model, prompt, **vars(obs), **given)


register(DiffusionGemmaSampler())
