"""What `generate` returns: the final tokens, the trajectory (who was committed when, with what
confidence), the reducers' records and the trajectory cache."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from mdm_lens import validate


@dataclass
class Trajectory:
    """Per-step facts of a run. Positions index the final sequence `[batch, pos]`.

    `x_steps[s]` is the canvas *before* step s: the model input of step s, before that step's commits (so
    `x_steps[0]` is the prompt followed by masks, and the final tokens are `GenerateOutput.tokens`, not in
    `x_steps`). ARM runs: the prefix of step s, padded with -1 where not yet generated.

    `commit_step`: -1 = prompt; -2 = never committed: the run ended first (LLaDA2 stops after the block holding
    EOS, leaving later blocks masked, and returns a block whose steps ran out with its masks, as its reference).
    A position committed *as* the mask id (the model sampled the mask token) holds that step and the mask id.
    A block run whose answer span still holds the mask id warns (`MaskedAnswerWarning`); SDAR refuses it."""

    x_steps: Int[Tensor, "step batch pos"]  # model input at each step, before its commits
    commit_step: Int[Tensor, "batch pos"]  # step that committed each position; -1: prompt; -2: never committed
    commit_confidence: Float[Tensor, "batch pos"]  # the sampler's confidence at commit (NaN: prompt/none)
    n_committed: Int[Tensor, "step batch"]  # positions whose commit_step is that step
    block_of_step: Int[Tensor, "step"]
    # DiffusionGemma only (None elsewhere, where accepted = committed): the samples each step keeps in the next
    # step's input, re-decided every step (see mdm_lens.diffusion.diffusion_gemma)
    accepted: Bool[Tensor, "step batch pos"] | None = None
    # block samplers only (llada2, sdar, fastdllm_v2; None elsewhere): per step, what its forward read, for `replay`:
    # the whole canvas `x` (beyond prompt + gen_length too), `block`, `block_slice`, `n_steps`/`n_blocks` of its
    # state, the forward-time `extra` (kind, query_start, query_end, block_length, kv_age, block_cache), its rows /
    # key columns (`DenoisingState.query_rows` / `key_cols`) and, where the sampler sets them otherwise than
    # `replay` would rebuild them (fastdllm_v2), its masked / prompt / key_visible sets
    forwards: list[dict] | None = None
    # variable-length samplers only (dreamon, indel; None elsewhere): the slot map of every step's canvas and
    # each slot's commit / removal (mdm_lens.diffusion.varlen.LengthTrace). There x_steps[s] column j is a column of
    # step s's canvas (−1 beyond it), not one position across steps; commit_step indexes the final tokens.
    length: Any = None

    @property
    def n_steps(self) -> int:
        return int(self.x_steps.shape[0])

    def committed_at(self, step: int) -> Bool[Tensor, "batch pos"]:
        """The positions committed at step `step` (negatives count from the end; out of range is refused, not
        wrapped round)."""
        n = self.n_steps
        return self.commit_step == validate.index(step, n, name="step", what=f"step of this {n}-step run")

    def order(self, row: int = 0) -> list[int]:
        """Generated positions of one row in the order they were committed (ties by position)."""
        row = validate.index(row, self.commit_step.shape[0], name="row", what="batch row")
        cs = self.commit_step[row]
        gen = (cs >= 0).nonzero().flatten().tolist()
        return sorted(gen, key=lambda p: (int(cs[p]), p))

    def __repr__(self) -> str:
        n_steps, batch, total = self.x_steps.shape
        n_prompt = int((self.commit_step[0] == -1).sum())
        per_step = _short(self.n_committed[:, 0].tolist())
        accepted = "" if self.accepted is None else f", accepted per step {_short(self.accepted[:, 0].sum(-1).tolist())}"
        order = self.order(0)
        shown = order if len(order) <= 16 else order[:12] + ["…"]
        n_blocks = int(self.block_of_step.max()) + 1 if n_steps else 0
        return (f"Trajectory(steps={n_steps}, batch={batch}, positions={total} (prompt {n_prompt}), "
                f"blocks={n_blocks}; row 0 commits per step {per_step}{accepted}, commit order {shown}; "
                "x_steps[s] = canvas before step s)")


def model_key(model: Any) -> tuple:
    """What identifies a model for a run's replay: its name and shape (two runs' models with the same key compute
    with the same architecture; the weights are sampled by `weights_sample`)."""
    c = model.cfg
    return (c.model_name, c.family, c.n_layers, c.d_model, c.n_heads, c.d_vocab, c.mask_token_id, c.attention)


def weights_sample(model: Any) -> tuple[float, ...] | None:
    """16 evenly spaced values of the first, middle and last parameter: equal for two loads of one checkpoint,
    different for another seed or checkpoint of the same shape. None where a weight is not here (offloaded to
    meta), so nothing is compared."""
    params = [p for _, p in model.named_parameters()]
    if not params:
        return None
    values: list[float] = []
    for p in (params[0], params[len(params) // 2], params[-1]):
        if p.is_meta:
            return None
        flat = p.detach().reshape(-1)
        values += flat[torch.linspace(0, flat.numel() - 1, 16, device=flat.device).long()].double().cpu().tolist()
    return tuple(values)


def require_output(out: Any, reads: str = "") -> None:
    """Refuse an `out` that is not a `GenerateOutput` (a consumer would otherwise misread it, e.g. as a run
    without a cache); `reads` says which run the consumer needs."""
    if not isinstance(out, GenerateOutput):
        from mdm_lens.errors import ArgumentTypeError

        raise ArgumentTypeError(f"out={validate.describe(out)} is not what model.generate returns" +
                                (f": {reads}." if reads else "."), argument="out", value=out,
                                allowed="a GenerateOutput")


@dataclass
class GenerateOutput:
    tokens: Int[Tensor, "batch pos"]
    prompt_length: int  # the canvas starts here (prompts are left-padded to this length)
    attention_mask: Int[Tensor, "batch pos"]
    trajectory: Trajectory
    sampler: str
    settings: dict[str, Any]
    causal: bool
    records: dict[str, Tensor] = field(default_factory=dict)
    record_meta: dict[str, dict] = field(default_factory=dict)
    cache: Any = None
    model_name: str = ""
    texts: list[str] | None = None  # decoded generations when the model has a tokenizer
    model_key: tuple | None = None  # `model_key(model)` of the model that ran (checked by replay and the probes)
    model_id: int | None = None  # id() of that model object: the same object passes, even with weights edited since
    model_weights: tuple | None = None  # `weights_sample` of that model at the run, compared for another object
    # block samplers whose reference returns a shorter span (LLaDA2: up to and including the first EOS): each
    # row's answer length from `prompt_length` (None: all generated tokens are answer)
    answer_length: list[int] | None = None

    def __post_init__(self) -> None:
        if hasattr(self.cache, "n_run"):  # negative cache indices count from the end of the run as it ran
            self.cache.n_run = self.trajectory.n_steps
            # ARM's last forward never reads the token it commits: aligned stacks are canvas-wide all the same
            self.cache.canvas_width = int(self.trajectory.x_steps.shape[-1])

    def check_model(self, model: Any, *, argument: str = "out") -> None:
        """Refuse a model other than the one this run was made with (its replay or lens would be numbers of another
        model on this run's canvases)."""
        from mdm_lens.errors import ArgumentTypeError, InputError

        if not hasattr(getattr(model, "cfg", None), "model_name"):
            raise ArgumentTypeError(f"model={validate.describe(model)} is not a model (a HookedMDM / HookedDDiT / "
                                    "bridge, whose cfg this run was made with).", argument="model", value=model,
                                    allowed="a model")
        if self.model_key is not None and model_key(model) != self.model_key:
            raise InputError(f"{argument}: the run was made by {self.model_name!r} {self.model_key[1:]}, not by "
                             f"the model given, {model.cfg.model_name!r} {model_key(model)[1:]}: pass the model that "
                             "ran it.",
                             argument=argument, value=self.model_name, allowed="a run of this model")
        if self.model_weights is None or id(model) == self.model_id:
            return
        now = weights_sample(model)
        if now is not None and now != self.model_weights:
            raise InputError(f"{argument}: the run was made by another model of the same shape "
                             f"({self.model_name!r}): the weights of the model given differ from the run's (another "
                             "seed, checkpoint or dtype); pass the model object that ran it (its weights may have "
                             "been edited since, on purpose) or a fresh load of the same checkpoint.",
                             argument=argument, value=self.model_name, allowed="a run of this model")

    @property
    def key_visible(self) -> Bool[Tensor, "batch pos"]:
        return self.attention_mask.bool()

    @property
    def generated(self) -> Int[Tensor, "batch gen"]:
        return self.tokens[:, self.prompt_length:]

    @property
    def n_steps(self) -> int:
        return self.trajectory.n_steps

    def state_at(self, step: int, phase: str = "cond") -> Any:
        """The `DenoisingState` that `model.state` held during step `step`'s forward pass (see `replay`)."""
        from mdm_lens.diffusion.replay import state_at

        return state_at(self, step, phase)

    def replay(self, model: Any, step: int, *, fwd_hooks: Any = (), hook_steps: Any = None,
               phase: str = "cond", grad: bool = False) -> Float[Tensor, "batch pos d_vocab"]:
        """Re-run step `step`'s forward pass outside `generate`: the same input canvas, the same `model.state`
        and the same step-bound hooks (an `at_steps(fn, [3])` hook fires only when replaying step 3; plain
        `fwd_hooks` follow `hook_steps`, default every step). Returns the position-aligned logits the sampler
        read at that step. `phase="uncond"` replays LLaDA's classifier-free-guidance pass. `grad=True` keeps the
        autograd graph (the samplers run without it), for gradients at that step."""
        from mdm_lens.diffusion.replay import replay

        return replay(self, model, step, fwd_hooks=fwd_hooks, hook_steps=hook_steps, phase=phase, grad=grad)

    def at_step(self, model: Any, step: int, phase: str = "cond") -> Any:
        """A context manager: `model.state` is step `step`'s state inside, and it yields `(tokens, kwargs)`, the
        step's forward input, for TL calls with gradients (`mdm_lens.diffusion.replay.at_step`)."""
        from mdm_lens.diffusion.replay import at_step

        return at_step(self, model, step, phase)

    def explore(self, model: Any = None, **kwargs: Any) -> Any:
        """The interactive step explorer of this run (`mdm_lens.views.explore`); shows inline in a notebook,
        `.save(path)` writes an offline HTML file."""
        from mdm_lens.views.explore import explore

        return explore(self, model, **kwargs)

    def __repr__(self) -> str:
        b, t = self.tokens.shape
        lines = [f"GenerateOutput({self.model_name or 'model'}, sampler={self.sampler}, batch={b}, "
                 f"prompt={self.prompt_length}, generated={t - self.prompt_length}, steps={self.n_steps})"]
        shown = {k: v for k, v in self.settings.items() if k not in ("seed",)}
        lines.append("  settings: " + ", ".join(f"{k}={v}" for k, v in shown.items()))
        lines.append(f"  commits per step (row 0): {_short(self.trajectory.n_committed[:, 0].tolist())}")
        if self.trajectory.accepted is not None:
            lines.append(f"  accepted per step (row 0): {_short(self.trajectory.accepted[:, 0].sum(-1).tolist())}")
        for name, value in self.records.items():
            axes = self.record_meta.get(name, {}).get("axes")
            lines.append(f"  records[{name!r}]: {tuple(value.shape)}" + (f" {axes}" if axes else ""))
        if self.cache is not None:
            lines.append(f"  cache: {self.cache!r}")
        if self.texts:
            for i, text in enumerate(self.texts[:4]):
                lines.append(f"  [{i}] {text!r}")
        return "\n".join(lines)


def _short(per_step: list) -> list:
    return per_step if len(per_step) <= 16 else per_step[:8] + ["…"] + per_step[-4:]


class TrajectoryRecorder:
    """Collects the trajectory while a sampler runs."""

    def __init__(self, batch: int, total: int, prompt_length: int, device: torch.device):
        self.x_steps: list[Tensor] = []
        self.blocks: list[int] = []
        self.n_committed: list[Tensor] = []
        self.commit_step = torch.full((batch, total), -2, dtype=torch.long)
        self.commit_step[:, :prompt_length] = -1
        self.commit_confidence = torch.full((batch, total), float("nan"))
        self.forwards: list[dict] | None = None

    def note(self, state: Any, sets: bool = False, canvas: bool = True) -> None:
        """Keep what the step's forward read (its whole canvas, state and rows), for `replay`; `sets`: also its
        masked / prompt / key_visible sets. `canvas=False` (LLaDA / Dream `kv_cache` loops, whose forward reads
        the step's `x_steps` canvas): rows, block and settings only, for `state_at`."""
        keys = ("kind", "query_start", "query_end", "kv_age", "block_length", "block_cache", "kv_cache", "refresh")
        extra = {k: (v.clone() if isinstance(v, Tensor) else v) for k, v in state.extra.items() if k in keys}
        f = dict(x=state.x.detach().cpu().clone() if canvas else None, block=state.block, block_slice=state.block_slice,
                 n_steps=state.n_steps, n_blocks=state.n_blocks, extra=extra, rows=state.rows, keys=state.keys)
        if sets:
            f.update({k: getattr(state, k).detach().cpu().clone() for k in ("masked", "prompt", "key_visible")})
        if self.forwards is None:
            self.forwards = []
        self.forwards.append(f)

    def record(self, step: int, block: int, x_in: Tensor, committed: Tensor, confidence: Tensor | None,
               state: Any = None) -> None:
        """One step's facts; `state` (block samplers): also note its forward for `replay`."""
        if state is not None:
            self.note(state, sets=True)
        pad = self.commit_step.shape[1] - x_in.shape[1]
        x = x_in.detach().cpu()
        if pad:
            x = torch.cat([x, x.new_full((x.shape[0], pad), -1)], dim=1)
        committed = committed.detach().cpu()
        if pad:
            committed = torch.cat([committed, committed.new_zeros((committed.shape[0], pad))], dim=1)
        self.x_steps.append(x)
        self.blocks.append(block)
        self.n_committed.append(committed.sum(-1))
        self.commit_step[committed] = step
        if confidence is not None:
            conf = confidence.detach().float().cpu()
            if pad:
                conf = torch.cat([conf, conf.new_full((conf.shape[0], pad), float("nan"))], dim=1)
            self.commit_confidence[committed] = conf[committed]

    def finish(self) -> Trajectory:
        return Trajectory(torch.stack(self.x_steps), self.commit_step, self.commit_confidence,
                          torch.stack(self.n_committed), torch.tensor(self.blocks), forwards=self.forwards)
