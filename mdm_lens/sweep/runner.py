"""`mdm_lens.sweep.run`: a dataset-scale sweep, data-parallel over ``torch.distributed`` ranks.

Batches are a function of the items and the arguments only (so they are the same whatever the world
size), see :func:`make_batches`. ``batching="length"`` (default) runs each equal-length group of a batch
as its own model calls, so no row is ever padded and a batched item's rows are bit-identical to the item
alone (temporal's excepted: the ``ReceivedAttention`` record's reduction depends on the batch size, ≈1e-8);
``batching="padded"`` left-pads the batch's mixed lengths into one run (fewer, fuller model calls; each row
equals the item alone up to fp32 rounding, ≈1e-7, which can flip the sampler's choice between two
near-equal confidences). With ``length``, accuracy's closed-book runs are units of their own after the
batches, cut the same way by closed-book prompt length (one sampler call per length, not per length and
batch). Unit k (batch or closed-book unit) runs on rank ``k % world_size``. Each rank writes its batches' part files;
rank 0 merges them in batch order once every rank is done, so 1 rank and N ranks give the same rows.

Resume and growth: the units are planned once and kept in the folder (:func:`extend_plan`, ``parts/plan.json``); a
rerun runs the same units (only those without a ``.done`` marker), and a higher ``limit`` adds units for the new
items only. Every argument and every item is checked (:mod:`mdm_lens.sweep.checks`) before ``out`` is touched.
Launch with ``torchrun --nproc-per-node N -m mdm_lens.sweep ...`` (gloo on CPU, nccl on GPU), or call
:func:`run` in one process.

Seeds: item i's seed is ``crc32(f"{seed}:{id}")`` (knockout's random control, retrieval's sampler run);
a batched sampler run is seeded with the seed of its first item. With the default greedy
samplers no randomness is drawn, and every row equals the item run alone.
"""

from __future__ import annotations

import heapq
import os
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import pandas as pd
import torch

from mdm_lens import validate
from mdm_lens.errors import ArgumentError, InputError
from mdm_lens.sweep import adapter as A
from mdm_lens.sweep import checks as C
from mdm_lens.sweep import manifest as M
from mdm_lens.sweep import templates as TM
from mdm_lens.sweep.items import SweepItem, read_items
from mdm_lens.sweep.store import SweepStore
from mdm_lens.sweep.summary import summarize
from mdm_lens.sweep.lengths import refuse_dropped

__all__ = ["run", "parse_probes", "item_seed", "make_batches", "extend_plan", "Plan", "DTYPES", "BATCHING"]

BATCHING = ("length", "padded")
LAYOUT = 3   # how items are cut into units (batches, closed-book units); part files of another layout are refused

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def item_seed(seed: int, item_id: str) -> int:
    return zlib.crc32(f"{seed}:{item_id}".encode()) & 0x7FFFFFFF


def parse_probes(probes: str | Sequence[str]) -> list[str]:
    names = [p.strip() for p in probes.split(",")] if isinstance(probes, str) else list(probes)
    names = [p for p in names if p]
    if not names:
        raise ArgumentError(f"--probes is empty; choose from {', '.join(A.PROBES)}.", argument="probes", value=probes,
                            allowed=A.PROBES)
    for p in names:
        validate.choice(p, A.PROBES, name="probes")
    return [p for p in A.PROBES if p in names]          # canonical order, no duplicates


def make_batches(lengths: Sequence[int], batch_size: int, batching: str) -> list[list[int]]:
    """Item indices per batch, each sorted by (length, data order).

    ``padded``: stable sort by length, then chunks of ``batch_size``. ``length``: every equal-length group
    (cut into chunks of ``batch_size``) is one run of the model, so the pieces are packed whole into batches
    of at most ``batch_size`` items (first-fit decreasing): as few runs as there are lengths, in full batches
    (per-batch costs, part files and closed-book sampler calls, do not grow with the spread of lengths)."""
    validate.choice(batching, BATCHING, name="batching")
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    if batching == "padded":
        return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    groups: dict[int, list[int]] = {}
    for i in order:
        groups.setdefault(lengths[i], []).append(i)
    pieces = [g[i:i + batch_size] for g in groups.values() for i in range(0, len(g), batch_size)]
    bins: list[list[int]] = []
    room: list[list[int]] = [[] for _ in range(batch_size + 1)]     # free places -> heap of bin indices
    for piece in sorted(pieces, key=len, reverse=True):              # stable: ties stay in length order
        n = len(piece)
        # first fit: the lowest-numbered bin with room for n (O(batch_size) per piece, not O(bins))
        fits = [(h[0], f) for f in range(n, batch_size + 1) if (h := room[f])]
        if fits:
            k, f = min(fits)
            heapq.heappop(room[f])
        else:
            k, f = len(bins), batch_size
            bins.append([])
        bins[k].extend(piece)
        if f > n:
            heapq.heappush(room[f - n], k)
    key = lambda i: (lengths[i], i)  # noqa: E731
    return sorted((sorted(b, key=key) for b in bins), key=lambda b: key(b[0]))


class _Dist:
    """World info; initialises the default process group from torchrun's environment when there is one."""

    def __init__(self, device: str):
        import torch.distributed as dist

        self.dist, self.created = dist, False
        env_world = int(os.environ.get("WORLD_SIZE", "1"))
        if not dist.is_initialized() and env_world > 1:
            dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
            self.created = True
        self.on = dist.is_initialized()
        self.rank = dist.get_rank() if self.on else 0
        self.world = dist.get_world_size() if self.on else 1

    def barrier(self) -> None:
        if self.on:
            self.dist.barrier()

    def broadcast(self, obj: Any) -> Any:
        if not self.on:
            return obj
        box = [obj]
        self.dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        if self.created:
            self.dist.destroy_process_group()


def _load(model: Any, device: str | None, dtype: str | None) -> Any:
    """A hub id / folder is loaded (float32 on cpu unless told); a loaded model is used as it is, and a
    ``device`` / ``dtype`` that is not its own is refused (the manifest must say what ran)."""
    if isinstance(model, str):
        from mdm_lens import HookedMDM

        return HookedMDM.from_pretrained(model, dtype=DTYPES[dtype or "float32"], device=device or "cpu")
    if dtype is not None and M.model_dtype(model) != dtype:
        raise ArgumentError(f"dtype={dtype!r} but the model passed is in {M.model_dtype(model)}; pass dtype=None "
                            "(or load the model in that dtype).", argument="dtype", value=dtype,
                            allowed=f"None or {M.model_dtype(model)!r}")
    have = M.model_device(model)
    if device is not None and not (have == device or (device == "cuda" and have.startswith("cuda"))):
        raise ArgumentError(f"device={device!r} but the model passed is on {have}; pass device=None (or move the "
                            "model).", argument="device", value=device, allowed=f"None or {have!r}")
    return model


def _progress(enabled: bool, total: int, world: int) -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="item", desc=f"sweep (rank 0 of {world})", dynamic_ncols=True)


def run(model: Any, data: str | Path, probes: str | Sequence[str], out: str | Path, *, limit: int | None = None,
        batch_size: int = 8, steps: int | None = None, gen_length: int | None = None, block_length: int | None = None,
        seed: int = 0, device: str | None = None, dtype: str | None = None, template: str = "auto",
        force: bool = False, skip_bad: bool = False, keep_keys: int = 1, n_random: int = 2, batching: str = "length",
        max_passages: int | None = None, progress: bool | None = None) -> dict[str, pd.DataFrame]:
    """Run ``probes`` over the items of ``data`` (jsonl) and write the tables to ``out``; see the module doc.

    ``model``: a hub id / local folder (loaded with ``dtype``, default float32, on ``device``, default cpu) or a
    loaded ``HookedMDM`` (then ``device`` / ``dtype``, when given, must be the model's own).
    ``limit``: the first N usable items; rerunning with a higher limit into the same folder computes only the
    new items. ``skip_bad``: skip malformed lines AND items a probe cannot use, recording why
    (``skipped.parquet``, the manifest). ``max_passages``: passages the ``rag`` / ``chat`` prompts show (default
    5; refused under the ``zoo`` template, which shows every passage).
    Returns ``{table: DataFrame}`` with the merged long tables (``accuracy``, ``absorption``, ``temporal``,
    ``temporal_keys``, ``qk``, ``retrieval``, ``flow``, ``knockout``, as asked), ``{probe}_summary`` and
    ``skipped``. Every argument is checked, and the data read, before the model is loaded; every item is checked
    before anything is written to ``out``.
    """
    t0 = time.perf_counter()
    asked = dict(model=model if isinstance(model, str) else model.cfg.model_name, data=str(data), probes=probes,
                 out=str(out), limit=limit, batch_size=batch_size, steps=steps, gen_length=gen_length,
                 block_length=block_length, seed=seed, device=device, dtype=dtype, template=template, force=force,
                 skip_bad=skip_bad, keep_keys=keep_keys, n_random=n_random, batching=batching,
                 max_passages=max_passages)
    names = parse_probes(probes)
    batch_size = validate.integer(batch_size, name="batch_size", min=1)
    limit = None if limit is None else validate.integer(limit, name="limit", min=1)
    seed = validate.seed(seed)
    keep_keys = validate.integer(keep_keys, name="keep_keys", min=0)
    n_random = validate.integer(n_random, name="n_random", min=0)
    if max_passages is not None:
        validate.integer(max_passages, name="max_passages", min=1)
    for v, n in ((steps, "steps"), (gen_length, "gen_length"), (block_length, "block_length")):
        if v is not None:
            validate.integer(v, name=n, min=1)
    if dtype is not None:
        validate.choice(dtype, tuple(DTYPES), name="dtype")
    validate.choice(template, TM.TEMPLATES, name="template")
    validate.choice(batching, BATCHING, name="batching")
    if device is not None:
        validate.choice(device.split(":")[0] if isinstance(device, str) else device, ("cpu", "cuda"), name="device")
    validate.boolean(force, name="force")
    validate.boolean(skip_bad, name="skip_bad")
    validate.output_folder(out, name="out", allowed="a folder (new or a sweep folder)")
    read = read_items(data, skip_bad=skip_bad)
    screened = C.screen(read.items, names, str(data), skip_bad, limit)
    if not screened.items:
        raise InputError(f"{data}: no usable items ({len(read.skipped) + len(screened.skipped)} skipped).",
                         argument="data", value=str(data))

    world = _Dist(device or "cpu")
    if (device or "cpu") == "cuda" and world.on:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', world.rank))}"
    try:
        model = _load(model, device, dtype)
        if model.tokenizer is None:  # the items are text: say what the CLI user can do (token ids are no option)
            raise InputError(f"the sweep reads text items, but {model.cfg.model_name!r} has no tokenizer: a checkpoint "
                             "folder needs its tokenizer.json beside config.json (from Python, pass a model after "
                             "`model.set_tokenizer(tok)`).", argument="model", value=model.cfg.model_name,
                             allowed="a model with a tokenizer")
        tmpl = TM.resolve_template(model, template)
        max_passages = TM.passages_shown(tmpl, max_passages)
        g = int(gen_length or model.cfg.extra.get("gen_length", 32))
        s = A.Settings(gen_length=g, steps=int(steps or g), block_length=block_length, keep_keys=keep_keys,
                       n_random=n_random, exact=batching == "length")
        from mdm_lens.diffusion.generate import default_sampler
        kw = A._gen_kwargs(model, s)
        refuse_dropped(model, kw, steps, block_length)
        C.check_sampler(model, kw)
        C.check_probes(model, names)  # probes this sampler's runs cannot give
        # their reference loops decode one prompt at a time (BD3LM: first hitting, its default, needs batch 1);
        # Fast-dLLM v2 lays a batch out from position 0 per row, so answer spans from the shortest prompt would
        # start inside a longer row's prompt
        if default_sampler(model) in ("llada2", "sdar", "bd3lm", "fastdllm_v2"):
            batch_size = 1
        sel = C.select(model, screened, names, tmpl, g, max_passages, str(data), skip_bad, limit)
        skipped = [dict(item_id=None, **d) for d in read.skipped] + sel.skipped
        if not sel.items:
            raise InputError(f"{data}: no usable items ({len(skipped)} skipped; first: {skipped[0]['reason']}).",
                             argument="data", value=str(data))
        items, rendered = sel.items, sel.rendered
        A.preflight(model, len(items), names, s)  # probes that bound the whole sweep (features' memory budget)
        fingerprint = dict(model=model.cfg.model_name, config_hash=M.config_hash(model),
                           data=str(Path(data).resolve()), data_hash=M.file_hash(str(data)), probes=names,
                           batch_size=batch_size, steps=kw.get("steps"), gen_length=g,
                           block_length=A.sweep_block_length(kw), seed=seed, dtype=M.model_dtype(model),
                           template=tmpl, keep_keys=keep_keys, n_random=n_random, batching=batching,
                           max_passages=max_passages, layout=LAYOUT)
        # every check is done: only now is anything written to ``out``
        store = SweepStore(out)
        store.keep_written = world.rank == 0
        plan = err = None
        closed = [TM.render(model, r.item, tmpl, context=False) for r in rendered] if "accuracy" in names else None
        if world.rank == 0:
            try:
                store.prepare(fingerprint, force)
                plan = extend_plan(store.load_plan(), [it.id for it in items], [len(r.ids) for r in rendered],
                                   None if closed is None or not s.exact else [len(c.ids) for c in closed],
                                   batch_size, batching)
                store.save_plan(plan.units)
            except ArgumentError as e:
                err = e
        err, plan = world.broadcast((err, plan))
        if err is not None:
            raise err
        store.set_batches({k: plan.units[k][1] for k in plan.active})
        with M.SamplerLog(model) as log, A.run_block_mask(model, A.sweep_block_length(kw)):
            info = _work(model, rendered, closed, plan, names, s, seed, store, world, progress, items)
        info.update(wall_s=round(time.perf_counter() - t0, 3), device=M.model_device(model), sampler=log.seen)
        store.write_rank(world.rank, info)
        world.barrier()
        if world.rank == 0:
            order = {it.id: i for i, it in enumerate(items)}
            merged = store.merge(plan.active, order)
            summaries = summarize(merged)
            store.write_tables(summaries, "_summary")
            store.write_tables({"skipped": _skipped_table(skipped)}, "")
            store.write_schema(list(merged) + [f"{k}_summary" for k in summaries] + ["skipped"])
            ranks = store.rank_infos()
            sampler = store.add_sampler_settings([e for r in ranks for e in r.pop("sampler", [])])
            done = store.done_items([k for k in plan.active if plan.units[k][0] == "batch"])
            store.write_manifest(M.build(fingerprint=fingerprint, asked=asked, read=read, n_selected=len(items),
                                         done=done, skipped=skipped, warnings=sel.warnings, ranks=ranks,
                                         sampler=sampler, model=model, world_size=world.world, tables=merged,
                                         wall=time.perf_counter() - t0))
        world.barrier()
        return _read_tables(Path(out), names)
    finally:
        world.close()


@dataclass
class Plan:
    """Every unit planned in the folder (by number: kind ``batch`` / ``book`` and item ids) and the numbers this
    run uses (``active``, ascending)."""

    units: list[tuple[str, list[str]]]
    active: list[int]


def extend_plan(old: list[tuple[str, list[str]]], ids: list[str], lengths: list[int], closed: list[int] | None,
                batch_size: int, batching: str) -> Plan:
    """The units of this run: the folder's planned units whose items are all selected (first come first: no item
    twice), then new units for the rest, numbered after the old ones: batches (:func:`make_batches` over the
    uncovered items' prompt lengths), then closed-book units (``closed``: closed-book lengths, or None when
    accuracy's closed-book rows run inside the batches). A rerun of the same items therefore runs the same
    units (resume = uninterrupted run), and a higher ``limit`` adds units for the new items only."""
    selected = set(ids)
    units = [(k, list(u)) for k, u in old]
    active: list[int] = []
    covered: dict[str, set[str]] = {"batch": set(), "book": set()}
    for k, (kind, members) in enumerate(units):
        if kind not in covered or (kind == "book" and closed is None):
            continue
        if set(members) <= selected and not covered[kind] & set(members):
            active.append(k)
            covered[kind] |= set(members)
    for kind, lens in (("batch", lengths), ("book", closed)):
        if lens is None:
            continue
        rest = [i for i, x in enumerate(ids) if x not in covered[kind]]
        for b in make_batches([lens[i] for i in rest], batch_size, batching):
            active.append(len(units))
            units.append((kind, [ids[rest[j]] for j in b]))
    return Plan(units, sorted(active))


def _with_gold_sets(tables: dict[str, pd.DataFrame], items: list[SweepItem]) -> dict[str, pd.DataFrame]:
    """Tables that carry ``gold_index`` (the smallest gold passage) get ``gold_indices`` too: the item's whole gold
    set as sorted comma-separated 0-based indices ("" when none), unless the table already has it."""
    gold = {it.id: ",".join(map(str, it.gold_indices)) for it in items}
    out = {}
    for name, df in tables.items():
        if "gold_index" in df.columns and "gold_indices" not in df.columns and "item_id" in df.columns:
            df = df.copy()
            df.insert(df.columns.get_loc("gold_index") + 1, "gold_indices", df["item_id"].map(gold))
        out[name] = df
    return out


def _skipped_table(skipped: list[dict]) -> pd.DataFrame:
    df = pd.DataFrame(skipped, columns=["item_id", "line", "reason"])
    return df.astype({"item_id": "object", "line": "int64", "reason": "object"})


def _work(model: Any, rendered: list[TM.Rendered], closed: list[TM.Rendered] | None, plan: Plan, names: list[str],
          s: A.Settings, seed: int, store: SweepStore, world: _Dist, progress: bool | None,
          items: list[SweepItem]) -> dict[str, Any]:
    """This rank's units of ``plan.active`` that are not done: unit k runs on rank ``k % world_size``. A ``batch``
    unit runs every probe (with ``--batching padded`` also accuracy's closed-book rows); a ``book`` unit only
    accuracy's closed-book rows."""
    index = {it.id: i for i, it in enumerate(items)}
    done = store.done_batches()
    mine = [k for k in plan.active if k % world.world == world.rank and k not in done]
    total = sum(len(plan.units[k][1]) for k in mine if plan.units[k][0] == "batch")
    show = world.rank == 0 and (progress if progress is not None else True)
    bar = _progress(show, total, world.world)
    t = time.perf_counter()
    n_items = 0
    try:
        for k in mine:
            kind, ids = plan.units[k]
            idx = [index[i] for i in ids]
            rows = [rendered[i] for i in idx]
            nocontext = None if closed is None else [closed[i] for i in idx]
            batch = A.make_batch(model, rows, nocontext, [item_seed(seed, r.item.id) for r in rows], idx)
            if kind == "book":
                tables = {"accuracy": A.accuracy_closed_book(model, batch, s)}
            else:
                tables = A.compute(model, batch, names, s, closed_book=not s.exact)
                n_items += len(rows)
            store.write_batch(k, _with_gold_sets(tables, items), batch.item_ids)
            if bar is not None and kind == "batch":
                bar.update(len(rows))
    finally:
        if bar is not None:
            bar.close()
    return dict(rank=world.rank, batches=len(mine), items=n_items, compute_s=round(time.perf_counter() - t, 3))


def _read_tables(root: Path, names: list[str]) -> dict[str, pd.DataFrame]:
    out = {}
    for p in sorted(root.glob("*.parquet")):
        out[p.stem] = pd.read_parquet(p)
    return out
