"""The step explorer: one self-contained interactive view of a denoising run (or of two runs side by side).

    out = model.generate(prompt, steps=16, gen_length=16, record=[ReceivedAttention()])
    out.explore(model)                     # inline in Jupyter / VS Code
    explore([out_mdm, out_arm], [mdm, arm]).save("explorer.html")   # offline file, no network

What it shows at step k (a slider, with play): the canvas as tokens coloured by the step that committed them
(prompt grey; a position committed after step k is shown as [MASK]; the tokens step k commits are outlined),
the attention each key receives at step k in the chosen layer and head (head mean by default) as a bar under
the token, the step's anchors (zscore rule of `probes.floating.detect_anchors` on that series) outlined in
red, the block being decoded and, on KV-cached runs with a `KeyValueNorms` record, each key's cache age.
Where a full pattern was cached (`cache="blocks.L.attn.hook_pattern" @ steps(...)`) the selected head's
pattern is drawn with a hover read-out; `lens_top1` (a `LensTrace` from `mdm_lens.lens.lens_trace`, placed at its
answer positions, or `[step, layer, pos]` token ids over the whole canvas) adds "top-1 at layer L" under each
position.

Step k's received attention is the forward *of* step k: its input is the canvas before step k's commits.

Why a small dependency-free renderer and not circuitsvis: the view needs linked state (one slider driving
several panels, read-back attributes for browser tests) that circuitsvis' React components do not expose, and
a ~10 KB script keeps a report with one explorer per model far below the size budget (the circuitsvis bundle
is 1.3 MB). Everything is inlined: the HTML references no URL.

Size: received attention is `steps × layers × heads × keys` numbers. Past `max_steps` the steps shown are
evenly spaced (first and last kept), past `max_heads` only the head mean is kept, and patterns wider than
`max_pattern_positions` are dropped; each reduction is stated on screen (`Explorer.notes`).
"""

from __future__ import annotations

import html as _html
import json
import math
import uuid
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor

from mdm_lens import validate
from mdm_lens.errors import ArgumentTypeError, InputError
from mdm_lens.hooks.record_steps import empty_reason, record_steps

__all__ = ["explore", "Explorer", "step_mapping"]

ASSETS = Path(__file__).parent / "assets"
RECORD = "received_attention"


@lru_cache(maxsize=None)
def _asset(name: str) -> str:
    return (ASSETS / name).read_text(encoding="utf-8")


def _r(x: float) -> float | None:
    """JSON number with 5 significant digits (the view shows 4); NaN -> null."""
    return None if not math.isfinite(x) else float(f"{x:.5g}")


def _rows(t: Tensor) -> Any:
    """A float tensor as nested lists of rounded numbers (null for NaN)."""
    if t.ndim == 0:
        return _r(float(t))
    return [_rows(s) for s in t] if t.ndim > 1 else [_r(v) for v in t.double().tolist()]


def step_mapping(n_from: int, n_to: int, step: int) -> int:
    """The step of a run with `n_to` steps shown beside step `step` of a run with `n_from` steps: the same
    fraction of the run, `round(step · (n_to − 1) / (n_from − 1))` (identity when the counts match)."""
    n_from = validate.integer(n_from, name="n_from", min=1)
    n_to = validate.integer(n_to, name="n_to", min=1)
    step = validate.integer(step, name="step", min=0, max=n_from - 1)
    if n_from == n_to:
        return step
    return 0 if n_from == 1 else int(round(step * (n_to - 1) / (n_from - 1)))


def _shown_steps(n: int, limit: int) -> list[int]:
    if n <= limit:
        return list(range(n))
    picked = {int(round(i * (n - 1) / (limit - 1))) for i in range(limit)}
    return sorted(picked)


def _str_tokens(out: Any, model: Any, item: int) -> list[str]:
    ids = out.tokens[item].tolist()
    tok = getattr(model, "tokenizer", None) if model is not None else None
    if tok is not None:
        return [str(s) for s in model.to_str_tokens(out.tokens[item])]
    return [f"#{i}" for i in ids]


def _received_name(out: Any, notes: list[str]) -> str | None:
    """The received-attention record: `RECORD`, else one made with `ReceivedAttention(name=...)` -- found by its
    meta (a "kind" of "mass"/"cumulative" and the [step, batch, layer, head, key] axes), since its name is the
    user's. Several such records: the first is shown and a note names the others."""
    if RECORD in out.records:
        return RECORD
    found = [n for n, m in out.record_meta.items() if n in out.records and m.get("kind") in ("mass", "cumulative")
             and tuple(m.get("axes", ())) == ("step", "batch", "layer", "head", "key")]
    if not found:
        notes.append(f"no received-attention record (looked for {RECORD!r} and any ReceivedAttention record "
                     f"under another name; records: {sorted(out.records) or 'none'}): generate with "
                     "record=[ReceivedAttention()] to see it")
        return None
    notes.append(f"received attention from the record {found[0]!r}"
                 + (f" (other received-attention records not shown: {found[1:]})" if len(found) > 1 else ""))
    return found[0]


def _received(out: Any, item: int, steps: list[int], max_heads: int, notes: list[str]) -> dict | None:
    """Per shown step, per recorded layer: [head..., mean] received attention of `item`."""
    name = _received_name(out, notes)
    if name is None:
        return None
    rec = out.records[name]
    if rec.shape[0] == 0:  # kept but empty (its steps reused MDLM's cache): the view says why there is no panel
        notes.append(empty_reason(out, name))
        return None
    meta = out.record_meta.get(name, {})
    layers = list(meta.get("layers", range(rec.shape[2])))
    rec_steps = record_steps(out, name, rec.shape[0])
    at = {s: i for i, s in enumerate(rec_steps)}
    # a block sampler's record spans its canvas rounded up to whole blocks: keep the run's positions only
    x = rec[:, item, ..., : out.tokens.shape[1]].float()  # [step, layer, head, key]
    causal, commit_step = bool(out.causal), out.trajectory.commit_step
    mean = x.mean(2, keepdim=True)
    if x.shape[2] > max_heads:
        notes.append(f"{x.shape[2]} heads > max_heads={max_heads}: only the head mean is shown")
        x = mean
        heads = ["mean"]
    else:
        x = torch.cat([x, mean], dim=2)
        heads = [str(h) for h in range(rec.shape[3])] + ["mean"]
    if causal:  # an ARM step's forward has only the prefix: later keys do not exist (records hold 0 there)
        cs = commit_step[item]
        x = x.clone()
        for s in steps:
            if s in at:
                x[at[s], :, :, cs[: x.shape[-1]] >= s] = math.nan
    values = [_rows(x[at[s]]) if s in at else None for s in steps]
    if meta.get("query") not in (None, "all"):
        notes.append(f"received attention over the query set {meta['query']!r}")
    if meta.get("kind") == "cumulative":  # a sum over queries, not a share: values above 1 are expected
        notes.append("cumulative received attention (sum over queries, not a share: a key's value can exceed 1)")
    return dict(layers=layers, heads=heads, values=values, kind=meta.get("kind", "mass"))


def _anchors(received: dict | None, key_visible: Tensor, causal: bool) -> list | None:
    """Anchor key positions per shown step, layer and head (zscore rule on that series)."""
    if received is None:
        return None
    from mdm_lens.probes.floating import detect_anchors

    out = []
    for per_step in received["values"]:
        if per_step is None:
            out.append(None)
            continue
        r = torch.tensor([[[math.nan if v is None else v for v in head] for head in layer] for layer in per_step],
                         dtype=torch.float64)
        vis = key_visible[: r.shape[-1]].expand_as(r) & r.isfinite()
        a = detect_anchors(r, key_visible=vis, causal=causal, nan_policy="omit")
        out.append([[row.nonzero().flatten().tolist() for row in layer] for layer in a])
    return out


def _kv_age(out: Any, item: int, steps: list[int]) -> list | None:
    """Per shown step, each position's cache age, looked up by the steps the record kept (not by run step)."""
    age = out.records.get("kv_age")
    if age is None:
        return None
    kept = record_steps(out, "kv_age", age.shape[0])
    at = {s: i for i, s in enumerate(kept)}
    age = age[:, item] if age.ndim == 3 else age
    return [age[at[s]].tolist() if s in at else None for s in steps]


def _block_span(out: Any, step: int) -> list[int] | None:
    """The canvas positions of the block step `step` decodes: the block samplers' own `block_slice` (blocks aligned
    at position 0), LLaDA's semi-AR block after the prompt; None for a run without blocks."""
    forwards = out.trajectory.forwards
    if forwards is not None and step < len(forwards) and forwards[step].get("block_slice") is not None:
        sl = forwards[step]["block_slice"]
        return [int(sl.start), int(sl.stop)]
    bl, gen = out.settings.get("block_length"), out.settings.get("gen_length")
    if not bl or not gen or bl >= gen or out.causal:
        return None
    start = out.prompt_length + int(out.trajectory.block_of_step[step]) * bl
    return [start, start + bl]


def _patterns(out: Any, item: int, steps: list[int], limit: int, notes: list[str]) -> dict | None:
    cache = out.cache
    names = [n for n in getattr(cache, "names", []) or [] if n.endswith("attn.hook_pattern")]
    if not names:
        return None
    got: dict[str, dict[str, Any]] = {}
    for name in names:
        layer = name.split(".")[1]
        for s in cache.steps:
            if s not in steps:
                continue
            p = cache[s][name][item].float()  # [head, query, key]
            width = out.tokens.shape[1]
            if p.shape[-1] > width and p.shape[-2] == p.shape[-1]:  # a block canvas: the run's positions only
                p = p[:, :width, :width]
            if p.shape[-1] > limit or p.shape[-2] > limit:
                notes.append(f"patterns of {p.shape[-2]}×{p.shape[-1]} > max_pattern_positions={limit}: not shown")
                return None
            if p.shape[-1] != p.shape[-2]:  # a KV-cached window's rows: query i is not position i
                notes.append(f"step {s}'s pattern holds {p.shape[-2]} query rows of a cached window: not drawn")
                continue
            got.setdefault(str(s), {})[layer] = _rows(torch.cat([p, p.mean(0, keepdim=True)], 0))
    return got or None


def _run_data(out: Any, model: Any, item: int, *, max_steps: int, max_heads: int, max_pattern_positions: int,
              lens_top1: Tensor | None, label: str) -> dict:
    validate.index(item, out.tokens.shape[0], name="item", what="batch row")
    notes: list[str] = []
    n = out.n_steps
    steps = _shown_steps(n, max_steps)
    if len(steps) < n:
        notes.append(f"{n} steps > max_steps={max_steps}: {len(steps)} evenly spaced steps shown")
    traj = out.trajectory
    visible = out.attention_mask[item].bool()
    received = _received(out, item, steps, max_heads, notes)  # its notes say why it is None, if it is
    kv_age = _kv_age(out, item, steps)
    data = dict(
        label=label, sampler=out.sampler, n_steps=n, steps=steps, notes=notes,
        tokens=_str_tokens(out, model, item), commit_step=traj.commit_step[item].tolist(),
        pad=(~visible).tolist(), block_of_step=traj.block_of_step.tolist(),
        block_length=out.settings.get("block_length"), prompt_length=int(out.prompt_length),
        received=received, anchors=_anchors(received, visible, bool(out.causal)),
        kv_age=kv_age, block_span=[_block_span(out, s) for s in steps],
        patterns=_patterns(out, item, steps, max_pattern_positions, notes),
        lens=None,
    )
    if lens_top1 is not None:
        data["lens"] = _lens(_canvas_lens(lens_top1, out, item, model), model, steps, n, out.tokens.shape[1])
    return data


def _canvas_lens(top1: Any, out: Any, item: int, model: Any) -> Any:
    """A `LensTrace` (answer positions, its own steps and layers) as the `[step, layer, canvas pos]` ids the view
    reads, -1 where it recorded nothing; anything else is returned as given."""
    if not all(hasattr(top1, a) for a in ("top1", "positions", "prompt_length", "layers", "steps", "n_steps")):
        return top1
    if top1.n_steps != out.n_steps or top1.prompt_length != out.prompt_length:
        raise InputError(f"lens_top1 is a lens trace of a run with {top1.n_steps} steps and prompt length "
                         f"{top1.prompt_length}; this run has {out.n_steps} and {out.prompt_length}: trace this run.",
                         argument="lens_top1", value=(top1.n_steps, top1.prompt_length),
                         allowed=f"a trace of this run ({out.n_steps} steps, prompt length {out.prompt_length})")
    at = [top1.prompt_length + p for p in top1.positions]
    final = getattr(top1, "final_tokens", None)
    # same step count and prompt length are not the same run: its final answer tokens must be this run's too
    if out.causal or (final is not None and (final.shape[0] != out.tokens.shape[0] or max(at) >= out.tokens.shape[1]
                                             or not torch.equal(final.cpu(), out.tokens[:, at].cpu()))):
        raise InputError("lens_top1 is a lens trace of another run (its final answer tokens differ from this run's"
                         f"{'; lens_trace never traces an ARM run' if out.causal else ''}): trace this run.",
                         argument="lens_top1", value="LensTrace", allowed="a trace of this run")
    n_layers = getattr(getattr(model, "cfg", None), "n_layers", None) or max(top1.layers) + 1
    ids = torch.full((out.n_steps, n_layers, out.tokens.shape[1]), -1, dtype=torch.long)
    at = torch.tensor(at)
    for i, step in enumerate(top1.steps):
        ids[step, torch.tensor(top1.layers)[:, None], at[None]] = top1.top1[i, :, item].long().cpu()
    return ids


def _lens(top1: Any, model: Any, steps: list[int], n_steps: int, n_pos: int) -> list:
    top1 = validate.tensor(top1, name="lens_top1")
    n_layers = getattr(getattr(model, "cfg", None), "n_layers", None)
    vocab = getattr(getattr(model, "cfg", None), "d_vocab", None)
    if not top1.is_floating_point() and top1.ndim == 3 and (
            (vocab is not None and bool((top1 >= vocab).any())) or bool((top1 < -1).any())):
        raise InputError(f"lens_top1 holds ids outside [-1, {vocab}): token ids of the model's vocabulary, -1 = none.",
                         argument="lens_top1", value=(int(top1.min()), int(top1.max())),
                         allowed=f"ids in [-1, {vocab})")
    if n_layers is not None and top1.ndim == 3 and top1.shape[1] > n_layers:
        raise InputError(f"lens_top1 has {top1.shape[1]} layers; the model has {n_layers}.", argument="lens_top1",
                         value=tuple(top1.shape), allowed=f"at most {n_layers} layers")
    if top1.ndim != 3 or top1.shape[0] != n_steps or top1.shape[2] != n_pos or top1.is_floating_point():
        # canvas positions: a lens_trace's top1 is over answer positions, so pass the trace itself
        raise InputError(f"lens_top1 has shape {tuple(top1.shape)} and dtype {top1.dtype}; expected integer token "
                         f"ids [step={n_steps}, layer, pos={n_pos}] over the whole canvas (-1 = none), or the "
                         "LensTrace of mdm_lens.lens.lens_trace itself (its top1 is over answer positions).",
                         argument="lens_top1", value=tuple(top1.shape),
                         allowed=f"an integer tensor [{n_steps}, layer, {n_pos}] or a LensTrace")
    tok = getattr(model, "tokenizer", None) if model is not None else None

    def name(i: int) -> str | None:
        if i < 0:
            return None
        return model.to_str_tokens(torch.tensor([i]))[0] if tok is not None else f"#{i}"

    return [[[name(int(i)) for i in layer] for layer in top1[s]] for s in steps]


@dataclass
class Explorer:
    """The rendered explorer: `html` is a fragment (a `<div>` with inlined CSS and script), `page()` a whole
    offline page; `_repr_html_` shows it in a notebook."""

    data: list[dict]
    title: str
    notes: list[str] = field(default_factory=list)
    uid: str = field(default_factory=lambda: "mdx-" + uuid.uuid4().hex[:10])

    @property
    def json(self) -> str:
        # "</" would end the <script> element early: JSON allows the escaped form
        return json.dumps(dict(runs=self.data, title=self.title, notes=self.notes),
                          separators=(",", ":")).replace("</", "<\\/")

    @property
    def html(self) -> str:
        return self.fragment()

    def fragment(self, show_title: bool = True) -> str:
        data = "" if show_title else ' data-title="0"'
        return (f'<div class="mdx-root" id="{self.uid}" data-mdm-lens="explorer"{data}></div>'
                f"<style>{_asset('explore.css')}</style>"
                f'<script type="application/json" id="{self.uid}-data">{self.json}</script>'
                f"<script>{_asset('explore.js')}\nmdxExplore({json.dumps(self.uid)});</script>")

    def _repr_html_(self) -> str:
        return self.html

    def page(self) -> str:
        return (f"<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{_html.escape(self.title)}"
                f"</title></head><body><main><h1>{_html.escape(self.title)}</h1>{self.fragment(show_title=False)}</main>"
                "</body></html>")

    def save(self, path: str | Path) -> Path:
        """Write the page to the file `path` (a folder, or a file under a missing folder, is refused)."""
        path = validate.output_file(path, name="path", suffixes=(".html", ".htm"))  # the page is HTML
        path.write_text(self.page(), encoding="utf-8")
        return path

    @property
    def size_bytes(self) -> int:
        return len(self.html.encode("utf-8"))


def explore(runs: Any, models: Any = None, *, item: int = 0, labels: Sequence[str] | None = None,
            lens_top1: Any = None, max_steps: int = 64, max_heads: int = 16, max_pattern_positions: int = 160,
            title: str | None = None) -> Explorer:
    """The step explorer of one run or of several side by side (see the module docstring).

    Args:
        runs: a `GenerateOutput` or a list of them (e.g. an MDM and its AR twin on one prompt, or a clean and a
            knocked-out run). Runs with equal step counts share the slider step for step; otherwise each run
            shows the step at the same fraction of its run (`step_mapping`), stated on screen.
        models: the model(s) that ran them (token strings; optional: without a tokenizer tokens show as ids).
        item: the batch row to show.
        lens_top1: per run (or one for a single run) a `LensTrace` of that run (`lens_trace(model, out)`), or
            `[step, layer, pos]` integer token ids over the canvas's positions, -1 = none.
    """
    def is_run(r: Any) -> bool:  # a GenerateOutput (duck-typed: the diffusion layer imports this module lazily)
        return all(hasattr(r, a) for a in ("trajectory", "tokens", "records", "record_meta", "settings"))

    single = is_run(runs)
    runs = [runs] if single else list(runs) if isinstance(runs, (list, tuple)) else runs
    if not isinstance(runs, list) or not runs or not all(is_run(r) for r in runs):
        raise InputError(f"runs={validate.describe(runs)} is invalid: expected a GenerateOutput or a non-empty list "
                         "of them.", argument="runs", value=runs, allowed="GenerateOutput or list of GenerateOutput")
    models = [models] * len(runs) if not isinstance(models, (list, tuple)) else list(models)
    if single and isinstance(lens_top1, (list, tuple)) and len(lens_top1) == 1:
        lens_top1 = lens_top1[0]  # one run, its lens given as a one-entry list
    if not single and lens_top1 is not None and not isinstance(lens_top1, (list, tuple)):
        raise ArgumentTypeError(f"lens_top1={validate.describe(lens_top1)} is invalid with {len(runs)} runs: expected "
                                "a list with one [step, layer, pos] token-id tensor (or None) per run.",
                                argument="lens_top1", value=lens_top1, allowed="a list of tensors, one per run")
    lenses = [lens_top1] * len(runs) if single or lens_top1 is None else list(lens_top1)
    for name, seq in (("models", models), ("lens_top1", lenses)):
        if len(seq) != len(runs):
            raise InputError(f"{name} has {len(seq)} entries for {len(runs)} runs.", argument=name, value=len(seq),
                             allowed=f"one per run ({len(runs)})")
    if isinstance(labels, str):  # one label: its characters are no list of labels
        if not single:
            raise ArgumentTypeError(f"labels={labels!r} is one str for {len(runs)} runs: give a list of str, one "
                                    "per run.", argument="labels", value=labels, allowed="a list of str, one per run")
        labels = [labels]
    if labels is not None and (not isinstance(labels, (list, tuple)) or not all(isinstance(x, str) for x in labels)):
        raise ArgumentTypeError(f"labels={validate.describe(labels)} is invalid: expected a list of str, one per "
                                "run.", argument="labels", value=labels, allowed="a list of str")
    if title is not None and not isinstance(title, str):
        raise ArgumentTypeError(f"title={validate.describe(title)} is invalid: expected a str or None.",
                                argument="title", value=title, allowed="a str or None")
    labels = list(labels) if labels is not None else [
        getattr(r, "model_name", "") or f"run {i}" for i, r in enumerate(runs)]
    if len(labels) != len(runs):
        raise InputError(f"labels has {len(labels)} entries for {len(runs)} runs.", argument="labels",
                         value=len(labels), allowed=f"one per run ({len(runs)})")
    max_steps = validate.integer(max_steps, name="max_steps", min=2)
    max_heads = validate.integer(max_heads, name="max_heads", min=1)
    max_pattern_positions = validate.integer(max_pattern_positions, name="max_pattern_positions", min=1)
    from mdm_lens.diffusion.fixed_length import require_fixed_length

    for r in runs:
        require_fixed_length(r, "explore", "its slider draws column j of every step under one token label, so a row "
                             "inserted at step s would be drawn under the token it displaced")
    for r, m in zip(runs, models):  # a tokenizer of another model would label this run's ids wrongly
        if m is not None:
            r.check_model(m, argument="models")
    data = [_run_data(r, m, item, max_steps=max_steps, max_heads=max_heads,
                      max_pattern_positions=max_pattern_positions, lens_top1=lt, label=str(lab))
            for r, m, lt, lab in zip(runs, models, lenses, labels)]
    notes = []
    counts = {d["n_steps"] for d in data}
    if len(counts) > 1:
        n0 = data[0]["n_steps"]
        notes.append("step counts differ (" + ", ".join(f"{d['label']}: {d['n_steps']}" for d in data) +
                     f"): each run shows step round(k · (n − 1) / ({n0} − 1)) for step k of {data[0]['label']}")
    return Explorer(data, title or "Denoising step explorer", notes)
