"""What the block-diffusion samplers (LLaDA2.x `sampler="llada2"`, SDAR `sampler="sdar"`) share.

Their canvas is laid out in blocks aligned at absolute position 0: the prompt fills the first blocks (its last,
partial block is completed by the first decoded block), and the canvas runs to the end of the block holding
position `prompt_length + gen_length - 1`. Decoding starts at block `prompt_length // block_length`.

* `out.tokens` is the prompt and the `gen_length` generated tokens; what the last block adds beyond them is
  canvas, not answer (hooks and `model.state` still see it). The trajectory covers the same positions.
* `DenoisingState.block` is the decoded block counted from the first one decoded (`n_blocks` of them);
  `block_slice` its absolute positions; `state.extra["query_start"]` / `["query_end"]` the rows the forward
  computes, `["block_length"]` the run's block length; `state.extra["kind"]` is "denoise", or "prefill" / "store" for SDAR's cache-filling forwards.
* Both references decode one prompt at a time (`x = torch.full((1, ...))`): a batch of more rows is refused.
* Sampling is the references' `sample_with_temperature_topk_topp`: temperature division, top-k then top-p
  filters, `torch.multinomial` (drawn from the run's seeded generator on CPU; the reference uses the global RNG).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from mdm_lens import tokenization
from mdm_lens.diffusion import arguments
from mdm_lens.diffusion.canvas import CanvasSampler, Plan
from mdm_lens.diffusion.output import GenerateOutput, model_key, Trajectory
from mdm_lens.diffusion.registry import Observation, progress_bar
from mdm_lens.errors import SamplerConfigError
from mdm_lens.hooks.runner import StepRunner


def layout(prompt_length: int, gen_length: int, block_length: int) -> tuple[int, int, int]:
    """(first decoded block, number of blocks, canvas length) of the aligned layout."""
    num_blocks = (prompt_length + gen_length + block_length - 1) // block_length
    return prompt_length // block_length, num_blocks, num_blocks * block_length


def block_length_for(model: Any, given: Any, family_default: int, sampler: str) -> Any:
    """The block length a block sampler decodes with: the caller's, else the checkpoint's (`cfg.extra`), else the
    reference's default, but only on a block-causal model: a bidirectional model with no block length was never
    trained under a block mask, so inventing one would decode it silently off-distribution."""
    if given is not None:
        return given  # explicit: the caller asks for block-causal decoding (checked by resolve)
    if model.cfg.extra.get("block_length") is not None:
        return model.cfg.extra["block_length"]
    if model.cfg.attention != "block_causal":
        raise SamplerConfigError(f"sampler={sampler!r} decodes block-causally, but {model.cfg.model_name} is "
                                 f"{model.cfg.attention} with no block length (cfg.extra['block_length']): it was "
                                 "not trained under a block mask. Use sampler='llada' (or 'auto'), or pass "
                                 "block_length= to decode it block-causally anyway.", argument="block_length",
                                 value=None, allowed="an explicit block_length on a model without one")
    return family_default


def transfer_schedule(block_length: int, steps: int) -> list[int]:
    """`get_num_transfer_tokens(block_length, steps)`: block_length // steps per step, the first
    block_length % steps steps one more (counts for a whole block, whatever it already holds)."""
    base, remainder = divmod(block_length, steps)
    return [base + (1 if i < remainder else 0) for i in range(steps)]


def top_k_logits(logits: Tensor, k: int | None) -> Tensor:
    if k is None or k <= 0:
        return logits
    kth = torch.topk(logits, k).values[..., -1, None]
    return torch.where(logits < kth, torch.full_like(logits, float("-inf")), logits)


def top_p_logits(logits: Tensor, p: float | None) -> Tensor:
    """Nucleus filter: drop the tokens after the smallest prefix (by probability) whose mass exceeds p."""
    if p is None or p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    cumulative = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1)
    drop = cumulative > p
    drop[..., 1:] = drop[..., :-1].clone()  # keep the token that crosses p
    drop[..., 0] = False
    mask = torch.scatter(torch.zeros_like(logits, dtype=torch.bool), -1, order, drop)
    return logits.masked_fill(mask, float("-inf"))


def sample_tokens(logits: Tensor, temperature: float, top_k: int | None, top_p: float | None,
                  generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """Tokens and their probabilities `[batch, pos]`: greedy at temperature 0 (LLaDA2's branch; SDAR refuses 0),
    else softmax(filtered logits / T) and one multinomial draw per row."""
    shape = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    if temperature == 0:
        probs = F.softmax(flat, dim=-1)
        token = torch.argmax(probs, dim=-1, keepdim=True)
        return token.view(*shape), torch.gather(probs, -1, token).view(*shape)
    if temperature != 1.0:
        flat = flat / temperature
    probs = F.softmax(top_p_logits(top_k_logits(flat, top_k), top_p), dim=-1)
    token = torch.multinomial(probs.cpu(), num_samples=1, generator=generator).to(probs.device)
    return token.view(*shape), torch.gather(probs, -1, token).view(*shape)


class BlockRecorder:
    """A `TrajectoryRecorder` over the answer positions only (the canvas beyond prompt + gen_length is dropped)."""

    def __init__(self, n: int, prompt_length: int, device: torch.device):
        from mdm_lens.diffusion.output import TrajectoryRecorder

        self.n = n
        self.inner = TrajectoryRecorder(1, n, prompt_length, device)
        self.forwards: list[dict] = []

    def note(self, state: Any) -> None:
        """What the step's forward read (the whole canvas and its state), kept for `replay`."""
        self.inner.note(state)
        self.forwards = self.inner.forwards

    def record(self, step: int, block: int, x_in: Tensor, committed: Tensor, confidence: Tensor | None) -> None:
        conf = None if confidence is None else confidence[:, :self.n]
        self.inner.record(step, block, x_in[:, :self.n], committed[:, :self.n], conf)

    @property
    def x_steps(self) -> list[Tensor]:
        return self.inner.x_steps

    def finish(self) -> Trajectory:
        out = self.inner.finish()
        out.forwards = self.forwards
        return out


class AlignedBlockSampler(CanvasSampler):
    """A block-diffusion sampler over the aligned canvas (see the module docstring). Subclasses give
    `block_plan(s, first, num_blocks)` and `run(...)`, which returns (canvas, recorder, answer lengths).
    `whole_canvas`: `out.tokens` is the whole block canvas (a variable-length run's trajectory covers all of it)."""

    whole_canvas = False

    def is_neutral(self, option: str, value: Any, given: dict[str, Any]) -> bool:
        gen_length = given.get("gen_length")
        if option == "block_length" and value is not None and gen_length is not None and value == gen_length:
            return True  # as LLaDA's: one block over the canvas, what a sampler without blocks does
        if option in ("top_k", "top_p"):  # off: None, top_k 0, top_p 1 (both references filter nothing then)
            return value is None or (option == "top_k" and value == 0) or (option == "top_p" and value == 1.0)
        return super().is_neutral(option, value, given)

    def plan(self, s: Any, prompt_length: int | None = None) -> Plan:
        """With the prompt length unknown (`mdm_lens.diffusion.generate.plan`): the bound for the longest layout."""
        if prompt_length is None:
            first, num_blocks = 1, -(-s.gen_length // s.block_length) + 2  # a prompt block, a straddling block
        else:
            first, num_blocks, _ = layout(prompt_length, s.gen_length, s.block_length)
        return self.block_plan(s, first, num_blocks)

    def block_plan(self, s: Any, first: int, num_blocks: int) -> Plan:
        raise NotImplementedError

    def run_plan(self, s: Any, prompt_length: int) -> Plan:
        """This prompt's layout (`steps` is per block), as `generate` runs it."""
        return self.plan(s, prompt_length)

    def run_extent(self, s: Any, batch: int, prompt_length: int) -> tuple[int, int]:
        """The run's forwards over the block-rounded canvas, as `generate` sizes them."""
        return self.run_plan(s, prompt_length).n_steps, layout(prompt_length, s.gen_length, s.block_length)[2]

    def check_prompt_ids(self, model: Any, ids: Tensor, s: Any) -> None:
        """A sampler's own checks of the prompt ids (before compute)."""

    def forward_extents(self, s: Any, prompt_length: int) -> list[tuple[int, int, int, int]] | None:
        """LLaDA2: each step forwards the canvas up to its block's end, no cache: at most the whole block-rounded
        canvas, of which the block's rows are sampled (SDAR overrides: a KV cache)."""
        total = layout(prompt_length, s.gen_length, s.block_length)[2]
        return [(total, total, 0, s.block_length)]

    # int64 bytes per canvas position and step that the recorder's forward notes keep beside x_steps (the forward's
    # canvas copy; SDAR also its cache ages)
    note_bytes = 8

    def trajectory_bytes(self, s: Any, batch: int, prompt_length: int, steps: int) -> int:
        """x_steps over the answer span and each forward's note over the block-rounded canvas, for every step of the
        layout's plan (`steps` is per block here)."""
        n_steps = self.plan(s, prompt_length).n_steps
        total = layout(prompt_length, s.gen_length, s.block_length)[2]
        return n_steps * batch * ((prompt_length + s.gen_length) * 8 + total * self.note_bytes)

    def logit_bytes(self, s: Any, dtype_bytes: int) -> int:
        """`sample_tokens` on the block's logits: temperature 0 keeps the softmax; otherwise the scaled copy, the
        top-k copy, top-p's sorted logits (+ int64 order), their softmax and cumulative sum, two boolean masks and
        the filtered copy, then the softmax that is drawn from."""
        if not s.temperature:
            return dtype_bytes
        top_k = dtype_bytes if s.top_k else 0
        top_p = 5 * dtype_bytes + 8 + 2 if s.top_p is not None and s.top_p < 1 else 0
        return 2 * dtype_bytes + top_k + top_p

    def check_inputs(self, model: Any, ids: Tensor, am: Tensor, s: Any, obs: Observation) -> None:
        arguments.one_unpadded_row(self.name, ids, am, "its reference builds a canvas of one row")
        prompt_length = ids.shape[1]
        self._check_prompt(model, ids, s.gen_length)
        total = layout(prompt_length, s.gen_length, s.block_length)[2]
        if total > model.cfg.n_ctx:
            raise SamplerConfigError(f"the block canvas runs to position {total} (prompt {prompt_length} + gen_length "
                                     f"{s.gen_length}, rounded up to whole blocks of {s.block_length}), beyond the "
                                     f"context of {model.cfg.n_ctx}.", argument="gen_length", value=s.gen_length,
                                     allowed=f"a canvas of at most {model.cfg.n_ctx} positions")
        self.check_prompt_ids(model, ids, s)
        self.check_run(ids, am, s, obs)

    def generate(self, model: Any, prompt: Any, s: Any, obs: Observation) -> GenerateOutput:
        ids, am = arguments.prompt_tokens(model, prompt, obs.attention_mask)
        self.check_inputs(model, ids, am, s, obs)
        prompt_length = ids.shape[1]
        first, num_blocks, total = layout(prompt_length, s.gen_length, s.block_length)
        runner = StepRunner(model, fwd_hooks=obs.fwd_hooks, hook_steps=obs.hook_steps, record=obs.record,
                            cache=obs.cache)
        plan = self.run_plan(s, prompt_length)
        runner.refuse_end_relative(plan.adaptive or "")
        runner.begin(1, total, plan.n_steps, n_blocks=plan.n_blocks, phases=plan.phases)  # before compute
        generator = torch.Generator().manual_seed(obs.seed) if obs.seed is not None else None
        bar = progress_bar(obs.progress, plan.n_steps, f"{self.name} sampling")
        x = torch.full((1, total), model.cfg.mask_token_id, dtype=torch.long, device=ids.device)
        x[:, :prompt_length] = ids
        try:
            with torch.no_grad():
                x, recorder, answer = self.run(runner, model, x, prompt_length, s, plan, generator, bar)
        finally:
            if bar is not None:
                bar.close()
        runner.warn_unreached(len(recorder.x_steps))
        records, meta = runner.records()
        n = prompt_length + s.gen_length
        tokens = x if self.whole_canvas else x[:, :n]
        # the returned span: up to the answer's end (LLaDA2: its first EOS) and the last block a forward decoded
        # (blocks after a stop rule never ran: their masks are the reference's output, not a failed block)
        decoded = max((f["block_slice"].stop for f in recorder.forwards if f["block_slice"] is not None), default=n)
        arguments.warn_masked(tokens, prompt_length, [min(s.gen_length if a is None else a, decoded - prompt_length)
                                                      for a in answer], model.cfg.mask_token_id, self.name)
        texts = None
        if model.tokenizer is not None:
            stop = [prompt_length + (s.gen_length if a is None else a) for a in answer]
            texts = [tokenization.decode(model.tokenizer, row[prompt_length:end].tolist())
                     for row, end in zip(tokens.cpu(), stop)]
        settings = dict(s.as_dict(), seed=obs.seed, mask_id=model.cfg.mask_token_id)
        return GenerateOutput(tokens=tokens, prompt_length=prompt_length, attention_mask=torch.ones_like(tokens),
                              trajectory=recorder.finish(), sampler=self.name, settings=settings, causal=False,
                              records=records, record_meta=meta, cache=runner.cache, model_name=model.cfg.model_name,
                              texts=texts, model_key=model_key(model),
                              answer_length=None if all(a is None for a in answer) else
                              [s.gen_length if a is None else a for a in answer])

    def run(self, runner: Any, model: Any, x: Tensor, prompt_length: int, s: Any, plan: Plan,
            generator: torch.Generator | None, bar: Any) -> tuple[Tensor, BlockRecorder, list[int | None]]:
        raise NotImplementedError


def end_step(runner: Any, recorder: BlockRecorder, state: Any, x_in: Tensor, committed: Tensor,
             confidence: Tensor | None, bar: Any) -> None:
    state.confidence = None if confidence is None else confidence.float()
    state.committed = committed
    runner.end_step(state)
    recorder.note(state)
    recorder.record(state.step, state.block, x_in, committed, confidence)
    if bar is not None:
        bar.update(1)
