"""`export_activations`: activations of real denoising trajectories, step by step, written in SAELens'
cached-activation layout (see `export_store`), so an SAE can be trained on what an MDM computes while it
generates (`use_cached_activations=True`, `context_size=1`).

    ds = export_activations(model, "items.jsonl", "blocks.1.hook_resid_post", steps=steps(0, -1),
                            positions="masked", out="acts/")          # -> datasets.Dataset
    ds[0]   # {"blocks.1.hook_resid_post": [[...d_model]], "token_ids": [mask id], "item_id": "q17",
            #  "step": 0, "block": 0, "position": 23, "is_masked": True, "final_token_id": 812}

One row per (item, step, position, chosen by ``positions``) with one column per hook. At step s a row's
activation is that of the model's forward pass of step s (the "cond" pass), on the canvas *before* step s's
commits (`Trajectory.x_steps[s]`); ``token_ids`` is that input token, ``final_token_id`` the token the
position holds at the end, ``block`` the sampler's block of step s, ``position`` the index in the item's own
sequence (prompt first, no padding). A step exports only the positions its forward computed (its
`DenoisingState.query_rows`): SDAR / Fast-dLLM v2 forwards compute one block, LLaDA2's the canvas up to the block's
end, Fast-dLLM `kv_cache` windows their window; the cache's rows are mapped to positions through
`TrajectoryCache.rows_of`, so ``position`` is always the row's absolute position. ``positions``:

- ``"masked"``: positions still masked in step s's input (the ones the model is predicting at that step);
- ``"unmasked"``: the others: the prompt and the canvas positions committed at earlier steps;
- ``"generated"``: the canvas (every position after the prompt), masked or not;
- ``"all"``: every position of the sequence.

``data``: a jsonl path (the sweep's formats, rendered with its templates: `mdm_lens.sweep.items`), a list of
text prompts, or token ids (a `[batch, pos]` tensor or a list of id lists). Batches, seeds, resume and
data parallelism are the sweep's (`mdm_lens.sweep.runner`): items are cut into batches by prompt length
(`make_batches(..., "length")`), each equal-length group of a batch is ONE `generate` call (never padded),
seeded with `item_seed(seed, first item id)`, so a row equals `generate(ids_of_its_group, ...,
cache=hook @ steps(s))` at that position bit for bit; batch k runs on rank ``k % world_size`` (torchrun:
`torchrun --nproc-per-node N -m mdm_lens.cli export-activations ...`), and a rerun into the same folder
skips the batches whose ``.done`` marker exists. Rows are in batch order, then item, step, position:
the same whatever the world size.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

from mdm_lens.diffusion.fixed_length import require_fixed_length
from mdm_lens import validate
from mdm_lens.noisy import noisy_positions
from mdm_lens.errors import ArgumentError, InputError, SamplerConfigError
from mdm_lens.hooks.steps import as_steps
from mdm_lens.hooks.trajectory import TrajectoryCache
from mdm_lens.sae import export_store as ES
from mdm_lens.sae.export_plan import (SAMPLER_KEYS, Plan, Prompt, Source, check_hooks_arg, check_model,
                                      check_sampler_kwargs, data_hash, make_plan, parse_steps, read_data,
                                      render_prompts)
from mdm_lens.sweep import manifest as SM
from mdm_lens.sweep import runner as R
from mdm_lens.sweep import templates as TM
from mdm_lens.sweep.store import SweepStore

__all__ = ["export_activations", "parse_steps", "POSITIONS", "SAMPLER_KEYS"]

POSITIONS = ("masked", "unmasked", "all", "generated")
LAYOUT = 1  # how rows are cut into batches and laid out; a folder of another layout is refused


# --- rows ------------------------------------------------------------------------------------------------
def _select(positions: str, masked: Tensor, prompt_length: int) -> Tensor:
    if positions == "masked":
        return masked
    if positions == "unmasked":
        return ~masked
    keep = torch.ones_like(masked)
    if positions == "generated":
        keep[..., :prompt_length] = False
    return keep


def _group_rows(model: Any, out: Any, item_ids: list[str], plan: Plan, positions: str,
               store_dtype: str) -> dict[str, list]:
    """The rows of one `generate` output (its `TrajectoryCache` holds the plan's hooks at the chosen steps):
    per item, step, position, as numpy pieces per column."""
    require_fixed_length(out, "export_activations", "its rows are keyed by (item, step, position) with the final "
                         "token of that position, and a row inserted or deleted mid-run has no such position")
    x = out.trajectory.x_steps                                   # [step, batch, pos], canvas before each step
    cached = out.cache.steps
    step_t = torch.tensor(cached, dtype=torch.long)
    blocks = out.trajectory.block_of_step
    final = out.tokens.cpu()
    width = x.shape[-1]  # a block canvas past prompt + gen_length is not exported
    # rows by absolute position (NaN where a step's forward computed no row: blocks, kv_cache windows)
    acts = {h: out.cache.stack(h, align=True)[:, :, :width].flatten(3) for h in plan.hooks}
    computed = out.cache.computed()[:, :, :width]                  # [cached step, batch, pos]
    np_dtype = np.dtype(store_dtype)
    cols: dict[str, list] = {c: [] for c in (*plan.hooks, *ES.META_COLUMNS)}
    for b, item in enumerate(item_ids):
        xin = x[step_t, b]                                       # [cached step, pos]
        masked = noisy_positions(model.cfg, xin, out.prompt_length)
        chosen = _select(positions, masked, out.prompt_length) & computed[:, b]
        si, pos = chosen.nonzero(as_tuple=True)  # step-major, then position
        for h in plan.hooks:
            cols[h].append(acts[h][si, b, pos].to(torch.float32 if store_dtype == "float32" else torch.float16)
                           .numpy().astype(np_dtype, copy=False)[:, None, :])
        steps_of_rows = step_t[si]
        cols["token_ids"].append(xin[si, pos].numpy().astype(np.int32)[:, None])
        cols["item_id"].append(np.full(len(si), item, dtype=object))
        cols["step"].append(steps_of_rows.numpy().astype(np.int32))
        cols["block"].append(blocks[steps_of_rows].numpy().astype(np.int32))
        cols["position"].append(pos.numpy().astype(np.int32))
        cols["is_masked"].append(masked[si, pos].numpy())
        cols["final_token_id"].append(final[b, pos].numpy().astype(np.int32))
    return cols


def _run_batch(model: Any, prompts: list[Prompt], idx: list[int], plan: Plan, positions: str, seed: int,
               store_dtype: str) -> dict[str, np.ndarray]:
    """One batch: each equal-length group (in batch order) is one `generate` call, as in the sweep."""
    groups: dict[int, list[int]] = {}
    for i in idx:
        groups.setdefault(len(prompts[i].ids), []).append(i)
    pieces: dict[str, list] = {c: [] for c in (*plan.hooks, *ES.META_COLUMNS)}
    for g in groups.values():
        ids = torch.tensor([prompts[i].ids for i in g], dtype=torch.long, device=model.input_device)
        item_ids = [prompts[i].item_id for i in g]
        cache = TrajectoryCache(list(plan.hooks), plan.when, device="cpu")
        out = model.generate(ids, seed=R.item_seed(seed, item_ids[0]), cache=cache, progress=False, **plan.gen_kwargs)
        for c, v in _group_rows(model, out, item_ids, plan, positions, store_dtype).items():
            pieces[c] += v
    cols = {c: np.concatenate(v) for c, v in pieces.items()}
    cols["item_id"] = cols["item_id"].tolist()
    return cols


# --- the run ------------------------------------------------------------------------------------------
def export_activations(model: Any, data: Any, hooks: str | Sequence[str], *, out: str | Path, steps: Any = None,
                       positions: str = "masked", n_steps: int | None = None, gen_length: int | None = None,
                       block_length: int | None = None, batch_size: int = 8, seed: int = 0,
                       sampler_kwargs: dict[str, Any] | None = None, template: str = "auto", limit: int | None = None,
                       skip_bad: bool = False, store_dtype: str = "float32", device: str = "cpu",
                       dtype: str = "float32", force: bool = False, progress: bool | None = None) -> Any:
    """Export the activations at ``hooks`` over the denoising steps ``steps`` (None: every step; a step,
    a list, or `mdm_lens.steps(...)`) at ``positions`` of every item of ``data`` to the folder ``out``;
    returns the `datasets.Dataset` (``load_from_disk(out)``). See the module doc.

    ``n_steps`` / ``gen_length`` / ``block_length`` / ``sampler_kwargs`` (temperature, remasking, alg, ...)
    are `generate`'s settings; ``model``: a `HookedMDM` or a hub id / folder (loaded with ``dtype`` on
    ``device``); ``store_dtype``: "float32" (exact for fp32 / bf16 / fp16 models) or "float16". A rerun
    into ``out`` resumes; other arguments are refused unless ``force``. Every argument, the data and the
    hooks are checked before any generation.
    """
    t0 = time.perf_counter()
    positions = validate.choice(positions, POSITIONS, name="positions")
    batch_size = validate.integer(batch_size, name="batch_size", min=1)
    seed = validate.seed(seed)
    limit = None if limit is None else validate.integer(limit, name="limit", min=1)
    for v, n in ((n_steps, "n_steps"), (gen_length, "gen_length"), (block_length, "block_length")):
        if v is not None:
            validate.integer(v, name=n, min=1, error=SamplerConfigError)
    store_dtype = validate.choice(store_dtype, ES.STORE_DTYPES, name="store_dtype")
    validate.choice(dtype, tuple(R.DTYPES), name="dtype")
    validate.choice(template, TM.TEMPLATES, name="template")
    validate.choice(device.split(":")[0] if isinstance(device, str) else device, ("cpu", "cuda"), name="device")
    skip_bad, force = validate.boolean(skip_bad, name="skip_bad"), validate.boolean(force, name="force")
    when = as_steps(steps, name="steps")
    hooks = check_hooks_arg(hooks)
    sampler_kwargs = check_sampler_kwargs(sampler_kwargs)
    ES.require_datasets()
    src = read_data(data, skip_bad, limit)

    world = R._Dist(device)
    if device == "cuda" and world.on:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', world.rank))}"
    try:
        model = R._load(model, device, dtype)
        check_model(model)
        plan = make_plan(model, hooks, when, n_steps, gen_length, block_length, sampler_kwargs)
        prompts, tmpl = render_prompts(model, src, template, plan.settings["gen_length"])
        fingerprint = dict(kind="export_activations", layout=LAYOUT, model=model.cfg.model_name,
                           config_hash=SM.config_hash(model), data=src.path or f"<{src.kind}>",
                           data_hash=data_hash(src, prompts), hooks=list(plan.hooks), steps=repr(plan.when),
                           positions=positions, batch_size=batch_size, seed=seed, template=tmpl, limit=limit,
                           skip_bad=skip_bad, store_dtype=store_dtype, dtype=dtype,
                           settings=json.loads(json.dumps(plan.settings, default=str)))
        store = SweepStore(out)
        store.keep_written = False
        err = None
        if world.rank == 0:
            try:
                store.prepare(fingerprint, force)
                if force:
                    ES.clear(store.root)
            except ArgumentError as e:
                err = e
        err = world.broadcast(err)
        if err is not None:
            raise err
        batches = R.make_batches([len(p.ids) for p in prompts], batch_size, "length")
        store.set_batches([[prompts[i].item_id for i in b] for b in batches])
        feats = ES.features(plan.hooks, store_dtype)
        info = _work(model, prompts, batches, plan, positions, seed, store_dtype, feats, store, world, progress)
        store.write_rank(world.rank, {**info, "wall_s": round(time.perf_counter() - t0, 3)})
        world.barrier()
        if world.rank == 0:
            _finish(store, batches, plan, fingerprint, src, prompts, model, device, out, batch_size, store_dtype,
                    seed, world, t0)
        world.barrier()
        return ES.require_datasets().load_from_disk(str(out))
    finally:
        world.close()


def _work(model: Any, prompts: list[Prompt], batches: list[list[int]], plan: Plan, positions: str, seed: int,
          store_dtype: str, feats: Any, store: SweepStore, world: Any, progress: bool | None) -> dict[str, Any]:
    done = store.done_batches()
    mine = [k for k in range(len(batches)) if k % world.world == world.rank and k not in done]
    bar = None
    if world.rank == 0 and (progress if progress is not None else True):
        from tqdm.auto import tqdm

        bar = tqdm(total=sum(len(batches[k]) for k in mine), unit="item", desc=f"export (rank 0 of {world.world})",
                   dynamic_ncols=True)
    t, rows, items = time.perf_counter(), 0, 0
    try:
        for k in mine:
            cols = _run_batch(model, prompts, batches[k], plan, positions, seed, store_dtype)
            ES.write_shard(store.parts, k, cols, feats)
            store.write_batch(k, {}, [prompts[i].item_id for i in batches[k]])  # the .done marker, last
            rows, items = rows + len(cols["step"]), items + len(batches[k])
            if bar is not None:
                bar.update(len(batches[k]))
    finally:
        if bar is not None:
            bar.close()
    return dict(rank=world.rank, batches=len(mine), items=items, rows=rows, compute_s=round(time.perf_counter() - t, 3))


def _finish(store: SweepStore, batches: list[list[int]], plan: Plan, fingerprint: dict, src: Source,
            prompts: list[Prompt], model: Any, device: str, out: Any, batch_size: int, store_dtype: str, seed: int,
            world: Any, t0: float) -> None:
    done = store.done_batches()
    missing = [k for k in range(len(batches)) if k not in done]
    if missing:
        raise InputError(f"{out}: batches {missing[:8]} are not done after every rank finished.", argument="out",
                         value=str(out), allowed="a folder no other run writes to")
    ds = ES.consolidate(store.root, store.parts, list(range(len(batches))))
    first = next(iter(plan.hooks))
    cfg = ES.saelens_config(data=src.path or f"<{src.kind}>", model_name=model.cfg.model_name, batch_size=batch_size,
                            hook=first, d_in=plan.hooks[first], n_rows=len(ds), store_dtype=store_dtype, seed=seed,
                            device=device, out=str(out))
    (store.root / "cache_activations_runner_cfg.json").write_text(json.dumps(cfg, indent=2))
    store.write_manifest({
        "arguments": {**fingerprint, "out": str(out), "device": device},
        "versions": SM.versions(),
        "hooks": plan.hooks,
        "columns": list(ds.column_names),
        "items": len(prompts),
        "items_skipped": len(src.skipped),
        "skipped": list(src.skipped)[:1000],
        "rows": len(ds),
        "world_size": world.world,
        "ranks": store.rank_infos(),
        "wall_s": round(time.perf_counter() - t0, 3),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    })
