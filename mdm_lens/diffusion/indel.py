"""LLaDA2.2's InDel decoding (insertion / deletion), as SGLang's `JointThresholdInDel` does it
(`sgl-project/sglang@7c7e7941 python/sglang/srt/dllm/algorithm/joint_threshold_indel.py`, families-2.md §10):
`generate(model, prompt, sampler="indel", gen_length=..., block_length=...)` on a LLaDA2.x model whose config
names the edit tokens (`cfg.extra["delete_token_id"]` / `["split_token_id"]`, read from config.json).

Blocks aligned at position 0, as LLaDA2's sampler (`mdm_lens.diffusion.blockwise`). Per block, at most
`block_length + max_post_edit_steps + 1` forwards over the canvas up to the block's end (block-causal mask); each
reads the block's logits greedily (argmax, softmax probability `p`) and:

* M2T: while masks the block started with ("original" masks, a flag that travels with its row) remain, commits the
  masks with `p > threshold` if at least `1 + #introduced masks` pass, else the `1 + #introduced` most confident;
  once none remains, every mask;
* post-edit budget: each forward with no original mask left counts; past `max_post_edit_steps` the DELETE / SPLIT
  predictions are replaced by the next-best token and the block ends after this forward;
* T2T: rewrites every non-mask, non-prompt row whose argmax differs with `p > edit_threshold`;
* nothing to write: the block ends (no write); anti-loop: a block content seen before forces the lowest-confidence
  changing row to its best token not yet written there (history by row index, as in the reference);
* edits left to right over the written block: DELETE drops the row, SPLIT becomes `[MASK, previous token]` (the
  new mask is not original); the block is padded with masks / truncated back to `block_length`.

Decoding stops after a block whose generated part holds EOS; `out.answer_length` ends at the first EOS (capped at
`gen_length`). `out.tokens` is the whole block canvas (prompt + whole blocks). Prompts holding the mask, DELETE or
SPLIT id are refused (the reference would decode / apply them).

Exactness notes. SGLang forwards each block against a KV cache of the earlier blocks; this sampler forwards the
canvas prefix as LLaDA2's `generate` does: the same keys under a block-causal mask when the cache holds each
block's final tokens. Whether it does at the pinned commit is [U] (there a block's last forward precedes its last
write; later SGLang adds a "persist" forward so that it does). SGLang's first forward of a block that holds no mask, and the forward after the
step budget is spent, read logits nobody uses: they are not run here. Rows move, so the run is variable-length
(`mdm_lens.diffusion.varlen`): `model.state.slot` / `.origin` name each column, `out.trajectory.length` keeps every
step's slot map (canvas width is constant, the rows are not), `state.extra` carries this step's `edited` (T2T),
`deleted` and `split` columns (in the step's own coordinates)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from mdm_lens import validate
from mdm_lens.diffusion import rules as R
from mdm_lens.diffusion.blockwise import AlignedBlockSampler, block_length_for, layout
from mdm_lens.diffusion.canvas import Plan
from mdm_lens.diffusion.registry import SamplerSettings, register, resolved
from mdm_lens.diffusion.state import DenoisingState
from mdm_lens.diffusion.varlen import LengthRecorder, Slots
from mdm_lens.errors import InputError, SamplerConfigError


@dataclass
class InDelSettings(SamplerSettings):
    """SGLang's defaults (`threshold 0.5, edit_threshold 0, max_post_edit_steps 16`); `block_length` None: the
    checkpoint's (`cfg.extra["block_length"]`, else 32); the edit and EOS ids come from the checkpoint."""

    gen_length: int = 2048
    block_length: int | None = None
    threshold: float = 0.5
    edit_threshold: float = 0.0
    max_post_edit_steps: int = 16
    delete_id: int | None = resolved()
    split_id: int | None = resolved()
    eos_id: int | None = resolved()

    def resolve(self, model: Any) -> "InDelSettings":
        bl = validate.integer(block_length_for(model, self.block_length, 32, "indel"), name="block_length", min=1,
                              error=SamplerConfigError)
        ids = [model.cfg.extra.get(k) for k in ("delete_token_id", "split_token_id")]
        if None in ids:
            raise SamplerConfigError(f"sampler 'indel' needs LLaDA2.2's edit tokens, and {model.cfg.model_name!r} "
                                     f"has delete_token_id={ids[0]!r}, split_token_id={ids[1]!r} (config.json keys "
                                     "read into cfg.extra). Set both on model.cfg.extra.",
                                     argument="delete_token_id", value=ids, allowed="two token ids of the vocabulary")
        for name, i in zip(("delete_token_id", "split_token_id"), ids):
            validate.integer(i, name=f"cfg.extra[{name!r}]", min=0, max=model.cfg.d_vocab - 1,
                             error=SamplerConfigError)
        validate.distinct_ids({"cfg.extra['delete_token_id']": ids[0], "cfg.extra['split_token_id']": ids[1],
                               "cfg.mask_token_id": model.cfg.mask_token_id}, error=SamplerConfigError,
                              why="InDel reads DELETE and SPLIT as two different edits, and a mask the model writes "
                                  "back would read as an edit (the loader refuses the same ids in config.json).")
        return dataclasses.replace(self, block_length=bl, delete_id=int(ids[0]), split_id=int(ids[1]),
                                   eos_id=model.cfg.eos_token_id)


InDelSettings.rules = {
    "gen_length": R.integer(1), "block_length": R.integer(1, none=True), "threshold": R.number(0, 1),
    "edit_threshold": R.number(0, 1), "max_post_edit_steps": R.integer(0),
}


@dataclass
class BlockBooks:
    """SGLang's per-block state: which rows are original masks (travels with the rows), the prompt rows, the
    post-edit count, the block contents seen and the tokens written per row index (anti-loop)."""

    is_orig: list[bool]
    prompt: Tensor
    post_edit_steps: int = 0
    seen: set = field(default_factory=set)
    history: dict = field(default_factory=dict)


@dataclass
class Decision:
    """One step's choice on the block (block coordinates): the tokens to write and where, with confidences."""

    x: Int[Tensor, "block"]
    p: Float[Tensor, "block"]
    transfer: Tensor  # rows written this step (M2T | T2T)
    edit: Tensor  # T2T rows
    done: bool  # the block ends after this step


def decide(logits: Float[Tensor, "block vocab"], blk: Int[Tensor, "block"], books: BlockBooks, s: InDelSettings,
           mask: int) -> Decision | None:
    """The reference's `step` up to the write (module docstring); None: nothing to write, the block is done."""
    x = torch.argmax(logits, dim=-1)
    p = torch.gather(F.softmax(logits, dim=-1), -1, x[:, None])[:, 0]
    masked = blk == mask
    n_orig = int((torch.tensor(books.is_orig, device=blk.device) & masked).sum())
    n_mask = int(masked.sum())
    m2t = torch.zeros_like(masked)
    if n_mask:
        conf = torch.where(masked, p, torch.full_like(p, float("-inf")))
        if n_orig:
            need, high = 1 + n_mask - n_orig, (conf > s.threshold) & masked
            if int(high.sum()) >= need:
                m2t = high
            else:
                m2t[torch.topk(conf, k=min(need, n_mask)).indices] = True
        else:
            m2t = masked
    force = False
    if n_orig == 0:
        books.post_edit_steps += 1
        force = books.post_edit_steps > s.max_post_edit_steps
        if force:  # no edit token survives the last forward: the next-best token instead (p is not updated)
            x = _without(logits, x, (x == s.delete_id) | (x == s.split_id), (s.delete_id, s.split_id))
    edit = (p > s.edit_threshold) & (blk != x) & ~masked & ~books.prompt
    transfer = m2t | edit
    if not bool(transfer.any()):
        return None
    key = tuple(blk.tolist())
    if key in books.seen and not force:
        changing = (transfer & (x != blk)).nonzero().flatten()
        if changing.numel():
            row = int(changing[p[changing].argmin()])
            x = x.clone()
            x[row] = _without(logits[row:row + 1], x[row:row + 1], None, books.history.get(row, ()))[0]
    books.seen.add(key)
    for row in transfer.nonzero().flatten().tolist():
        books.history.setdefault(row, set()).add(int(x[row]))
    return Decision(x, p, transfer, edit, force)


def _without(logits: Tensor, x: Tensor, rows: Tensor | None, banned: Any) -> Tensor:
    """`x` with the argmax over `logits` minus the `banned` tokens at `rows` (None: every row)."""
    out = logits.clone()
    out[:, list(banned)] = float("-inf")
    best = torch.argmax(out, dim=-1)
    return best if rows is None else torch.where(rows, best, x)


class InDelRun:
    """The canvas, its slot map and recorder through one run (block edits keep the canvas width)."""

    def __init__(self, x: Tensor, prompt_length: int, s: InDelSettings, mask: int):
        self.x, self.s, self.mask = x, s, mask
        prompt = torch.zeros_like(x, dtype=torch.bool)
        prompt[:, :prompt_length] = True
        self.slots = Slots(prompt)
        self.recorder = LengthRecorder(self.slots, x.shape[1])
        self.blocks: list[int] = []

    def write(self, step: int, blk: slice, d: Decision, books: BlockBooks) -> None:
        """The decision into the canvas: commits and T2T edits recorded by slot, then DELETE / SPLIT."""
        row = self.x[0, blk]
        old, ids = row.tolist(), self.slots.ids[0, blk].tolist()
        new = row.clone()
        new[d.transfer] = d.x[d.transfer]
        for i in d.transfer.nonzero().flatten().tolist():
            t = int(new[i])
            if t in (self.s.delete_id, self.s.split_id) or t == old[i]:
                continue
            if old[i] == self.mask:
                self.recorder.commit(step, ids[i], t, float(d.p[i]))
            else:
                self.recorder.edit(step, ids[i])
        if bool(((new == self.s.delete_id) | (new == self.s.split_id)).any()):
            new, books.is_orig, ids = self._edit(step, new.tolist(), old, books.is_orig, ids)
            new = torch.tensor(new, dtype=self.x.dtype, device=self.x.device)
        self.x[0, blk] = new
        ids_now = self.slots.ids.clone()  # a new tensor: states and caches of earlier steps hold the old map
        ids_now[0, blk] = torch.tensor(ids, dtype=ids_now.dtype)
        self.slots.ids = ids_now

    def _edit(self, step: int, new: list, old: list, is_orig: list, ids: list) -> tuple[list, list, list]:
        toks, orig, slots, bl = [], [], [], len(new)
        for i, t in enumerate(new):
            if t == self.s.delete_id:
                self.recorder.remove(step, ids[i], "deleted")
            elif t == self.s.split_id:  # a fresh mask slot before the row, which keeps its slot and flag
                toks += [self.mask, old[i]]
                orig += [False, is_orig[i]]
                slots += [int(self.slots.new(1)[0]), ids[i]]
            else:
                toks.append(t)
                orig.append(is_orig[i])
                slots.append(ids[i])
        for gone in slots[bl:]:
            self.recorder.remove(step, gone, "truncated")
        pad = max(0, bl - len(toks))
        slots += self.slots.new(pad).tolist()
        return (toks + [self.mask] * pad)[:bl], (orig + [False] * pad)[:bl], slots[:bl]

    def state(self, step: int, n_steps: int, block: int, n_blocks: int, blk: slice) -> DenoisingState:
        x = self.x
        state = DenoisingState(step, n_steps, block, n_blocks, x.clone(), x == self.mask,
                               self.slots.prompt(x.device), torch.ones_like(x, dtype=torch.bool), blk,
                               slot=self.slots.ids.clone().to(x.device), n_original=self.slots.n_original)
        state.computes(0, blk.stop).extra.update(kind="denoise", query_start=blk.start, query_end=blk.stop,
                                                 block_length=self.s.block_length)
        return state


def indel_block(run: InDelRun, runner: Any, blk: slice, block: int, plan: Plan, step: int, bar: Any) -> int:
    """Decode one block (module docstring); returns the next step index."""
    s, mask = run.s, run.mask
    start = run.x[0, blk]
    books = BlockBooks(is_orig=(start == mask).tolist(), prompt=start != mask)
    if not bool((start == mask).any()):
        return step
    positions = torch.arange(blk.stop, device=run.x.device)[None]
    for _ in range(s.block_length + s.max_post_edit_steps + 1):
        state = run.state(step, plan.n_steps, block, plan.n_blocks, blk)
        run.recorder.step(state)
        run.blocks.append(block)
        logits = runner.forward(state, run.x[:, :blk.stop], position_ids=positions, block_length=s.block_length)
        d = decide(logits[0, blk], run.x[0, blk].clone(), books, s, mask)
        _end_step(runner, run, state, blk, d)
        if d is not None:
            run.write(step, blk, d, books)
        step += 1
        if bar is not None:
            bar.update(1)
        if d is None or d.done:
            break
    return step


def _end_step(runner: Any, run: InDelRun, state: DenoisingState, blk: slice, d: Decision | None) -> None:
    """Post-commit fields for the reducers, in the step's own (pre-edit) coordinates."""
    full = torch.zeros_like(state.x, dtype=torch.bool)
    confidence = torch.full(state.x.shape, float("-inf"), device=state.x.device)
    for key in ("edited", "deleted", "split"):
        state.extra[key] = full.clone()
    if d is not None:
        written = d.transfer & (d.x != run.x[0, blk])
        full[0, blk] = d.transfer & state.masked[0, blk] & (d.x != run.mask) & (d.x != run.s.delete_id) & \
            (d.x != run.s.split_id)
        confidence[0, blk] = torch.where(d.transfer, d.p.float(), confidence[0, blk])
        state.extra["edited"][0, blk] = d.edit & written
        state.extra["deleted"][0, blk] = d.transfer & (d.x == run.s.delete_id)
        state.extra["split"][0, blk] = d.transfer & (d.x == run.s.split_id)
    state.confidence, state.committed = confidence, full
    runner.end_step(state)


class InDelSampler(AlignedBlockSampler):
    """`generate(model, prompt, sampler="indel")` on a LLaDA2.x model with DELETE / SPLIT ids."""

    name, Settings = "indel", InDelSettings
    variable_length = True  # rows are inserted / deleted: consumers check it (varlen.refuse_variable_sampler)
    whole_canvas = True

    def check_model(self, model: Any) -> None:
        super().check_model(model)
        if model.cfg.logit_shift:
            raise SamplerConfigError(f"sampler 'indel' decodes LLaDA2.x (unshifted logits); {model.cfg.model_name!r} "
                                     "shifts its logits (Dream family).", argument="sampler", value=self.name,
                                     allowed="a LLaDA2.x model with edit tokens")

    def logit_bytes(self, s: InDelSettings, dtype_bytes: int) -> int:
        """Greedy: the block's softmax (for `p`) beside its argmax, as the block samplers at temperature 0 (InDel
        has no temperature / top-k / top-p settings)."""
        return dtype_bytes

    def block_plan(self, s: InDelSettings, first: int, num_blocks: int) -> Plan:
        return Plan((s.block_length + s.max_post_edit_steps + 1) * (num_blocks - first), num_blocks - first,
                    adaptive="InDel ends a block when nothing is left to write and stops at EOS")

    def check_prompt_ids(self, model: Any, ids: Tensor, s: InDelSettings) -> None:
        for what, tok in (("DELETE", s.delete_id), ("SPLIT", s.split_id)):
            if bool((ids == tok).any()):
                raise InputError(f"the prompt contains the {what} token {tok}, which the reference would apply to "
                                 "the prompt's block; remove it.", argument="prompt", value=tok,
                                 allowed=f"ids other than {s.delete_id} and {s.split_id}")

    def run(self, runner: Any, model: Any, x: Tensor, prompt_length: int, s: InDelSettings, plan: Plan,
            generator: torch.Generator | None, bar: Any) -> tuple[Tensor, "_Finished", list[int | None]]:
        first, num_blocks, _ = layout(prompt_length, s.gen_length, s.block_length)
        run = InDelRun(x, prompt_length, s, model.cfg.mask_token_id)
        step = 0
        for nb in range(first, num_blocks):
            end = (nb + 1) * s.block_length
            step = indel_block(run, runner, slice(end - s.block_length, end), nb - first, plan, step, bar)
            if s.eos_id is not None and bool((run.x[0, prompt_length:end] == s.eos_id).any()):
                break
        n = prompt_length + s.gen_length
        found = (run.x[0, prompt_length:n] == s.eos_id).nonzero() if s.eos_id is not None else []
        return run.x, _Finished(run), [int(found[0, 0]) + 1 if len(found) else s.gen_length]


class _Finished:
    """What `AlignedBlockSampler.generate` reads of a recorder, over the variable-length books."""

    def __init__(self, run: InDelRun):
        self.run = run
        self.x_steps = run.recorder.x_steps
        self.forwards = run.recorder.forwards

    def finish(self) -> Any:
        return self.run.recorder.finish(self.run.x, self.run.blocks)


register(InDelSampler())
