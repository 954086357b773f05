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
Launch with ``torchrun --nproc-per-node N -m mdm_lens.sweep ...`` (gloo on CPU, nccl on GPU), or call
:func:`run` in one process.

Seeds: item i's seed is ``crc32(f"{seed}:{id}")`` (knockout's random control, retrieval's sampler run);
a batched sampler run is seeded with the seed of its first item. With the default greedy
samplers no randomness is drawn, and every row equals the item run alone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import json
import os
import platform
import time
import zlib
from pathlib import Path
from typing import Any, Sequence

import pandas as pd
import torch

from mdm_lens import validate
from mdm_lens.errors import ArgumentError, InputError
from mdm_lens.sweep import adapter as A
from mdm_lens.sweep import templates as TM
from mdm_lens.sweep.items import SweepItem, read_items
from mdm_lens.sweep.store import SweepStore
from mdm_lens.sweep.summary import summarize

__all__ = ["run", "parse_probes", "item_seed", "make_batches", "DTYPES", "BATCHING"]

BATCHING = ("length", "padded")
LAYOUT = 2   # how items are cut into units (batches, closed-book units); part files of another layout are refused

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


def _check_items(items: list[SweepItem], probes: list[str], path: str) -> None:
    for p, need in A.NEEDS_QA.items():
        if p not in probes:
            continue
        for it in items:
            ok = it.is_qa and bool(it.answers) if p == "accuracy" else (it.is_qa and bool(it.passages) and
                                                                           (p != "retrieval" or bool(it.answers)))
            if not ok:
                raise InputError(f"{path}:{it.line}: probe {p!r} needs {need}; item {it.id!r} has none. Drop {p!r} "
                                 "from --probes or fix the data.")


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


def _config_hash(model: Any) -> str:
    cfg = dataclasses.asdict(model.cfg) if dataclasses.is_dataclass(model.cfg) else dict(vars(model.cfg))
    cfg.pop("dtype", None)
    return hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _file_hash(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def _versions() -> dict[str, str]:
    import numpy
    import pyarrow

    import mdm_lens
    return {"mdm_lens": getattr(mdm_lens, "__version__", "?"), "torch": torch.__version__, "pandas": pd.__version__,
            "pyarrow": pyarrow.__version__, "numpy": numpy.__version__, "python": platform.python_version()}


def _load(model: Any, device: str, dtype: str) -> Any:
    if not isinstance(model, str):
        return model
    from mdm_lens import HookedMDM

    return HookedMDM.from_pretrained(model, dtype=DTYPES[dtype], device=device)


def _progress(enabled: bool, total: int, world: int) -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="item", desc=f"sweep (rank 0 of {world})", dynamic_ncols=True)


def run(model: Any, data: str | Path, probes: str | Sequence[str], out: str | Path, *, limit: int | None = None,
        batch_size: int = 8, steps: int | None = None, gen_length: int | None = None, block_length: int | None = None,
        seed: int = 0, device: str = "cpu", dtype: str = "float32", template: str = "auto", force: bool = False,
        skip_bad: bool = False, keep_keys: int = 1, n_random: int = 2, batching: str = "length",
        progress: bool | None = None) -> dict[str, pd.DataFrame]:
    """Run ``probes`` over the items of ``data`` (jsonl) and write the tables to ``out``; see the module doc.

    ``model``: a hub id / local folder (loaded with ``dtype`` on ``device``) or a loaded ``HookedMDM``.
    Returns ``{table: DataFrame}`` with the merged long tables (``accuracy``, ``absorption``, ``temporal``,
    ``temporal_keys``, ``qk``, ``retrieval``, ``flow``, ``knockout``, as asked) and ``{probe}_summary``.
    Every argument is checked, and the data read, before the model is loaded.
    """
    t0 = time.perf_counter()
    names = parse_probes(probes)
    batch_size = validate.integer(batch_size, name="batch_size", min=1)
    limit = None if limit is None else validate.integer(limit, name="limit", min=1)
    seed = validate.integer(seed, name="seed", min=0)
    keep_keys = validate.integer(keep_keys, name="keep_keys", min=0)
    n_random = validate.integer(n_random, name="n_random", min=0)
    for v, n in ((steps, "steps"), (gen_length, "gen_length"), (block_length, "block_length")):
        if v is not None:
            validate.integer(v, name=n, min=1)
    validate.choice(dtype, tuple(DTYPES), name="dtype")
    validate.choice(template, TM.TEMPLATES, name="template")
    validate.choice(batching, BATCHING, name="batching")
    validate.choice(device.split(":")[0], ("cpu", "cuda"), name="device")
    read = read_items(data, skip_bad=skip_bad)
    items = read.items[:limit] if limit else read.items
    if not items:
        raise InputError(f"{data}: no usable items" + (f" ({len(read.skipped)} skipped)" if read.skipped else "") + ".")
    _check_items(items, names, str(data))

    world = _Dist(device)
    if device == "cuda" and world.on:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', world.rank))}"
    try:
        model = _load(model, device, dtype)
        tmpl = TM.resolve_template(model, template)
        g = int(gen_length or model.cfg.extra.get("gen_length", 32))
        s = A.Settings(gen_length=g, steps=int(steps or g), block_length=block_length, keep_keys=keep_keys,
                       n_random=n_random, exact=batching == "length")
        A.preflight(model, len(items), names, s)
        fingerprint = dict(model=model.cfg.model_name, config_hash=_config_hash(model), data=str(Path(data).resolve()),
                           data_hash=_file_hash(str(data)), probes=names, batch_size=batch_size, steps=s.steps,
                           gen_length=g, block_length=block_length, seed=seed, dtype=dtype, template=tmpl,
                           skip_bad=skip_bad, keep_keys=keep_keys, n_random=n_random, limit=limit,
                           batching=batching, layout=LAYOUT)
        store = SweepStore(out)
        store.keep_written = world.rank == 0
        err = None
        if world.rank == 0:
            try:
                store.prepare(fingerprint, force)
            except ArgumentError as e:
                err = e
        err = world.broadcast(err)
        if err is not None:
            raise err
        rendered = _render(model, items, tmpl, s)
        closed = [TM.render(model, r.item, tmpl, context=False) for r in rendered] if "accuracy" in names else None
        batches = make_batches([len(r.ids) for r in rendered], batch_size, batching)
        # length: the closed-book runs are units of their own, packed by closed-book prompt length over all items
        # (one sampler call per length instead of per length and batch); padded: they run with their batch
        books = make_batches([len(c.ids) for c in closed], batch_size, batching) if closed and s.exact else []
        store.set_batches([[items[i].id for i in b] for b in batches + books])
        tables = _work(model, rendered, closed, batches, books, names, s, seed, store, world, progress)
        _ = t0
        info = dict(rank=tables.pop("__rank_info__"), wall_s=round(time.perf_counter() - t0, 3))
        store.write_rank(world.rank, {**info["rank"], "wall_s": info["wall_s"]})
        world.barrier()
        if world.rank == 0:
            merged = store.merge(list(range(len(batches) + len(books))), {it.id: i for i, it in enumerate(items)})
            summaries = summarize(merged)
            store.write_tables(summaries, "_summary")
            store.write_manifest(_manifest(fingerprint, read, items, store, world, model, device, out, data, limit,
                                           tmpl, merged, time.perf_counter() - t0, len(batches)))
        world.barrier()
        return _read_tables(Path(out), names)
    finally:
        world.close()


def _render(model: Any, items: list[SweepItem], tmpl: str, s: A.Settings) -> list[TM.Rendered]:
    """Every prompt, tokenised once (batches are cut by length); too long for the model → an error up front."""
    out = []
    for it in items:
        r = TM.render(model, it, tmpl)
        if len(r.ids) + s.gen_length > model.cfg.n_ctx:
            raise InputError(f"item {it.id!r} (line {it.line}): {len(r.ids)} prompt tokens + gen_length "
                             f"{s.gen_length} exceed the model's context of {model.cfg.n_ctx}.")
        out.append(r)
    return out


def _work(model: Any, rendered: list[TM.Rendered], closed: list[TM.Rendered] | None, batches: list[list[int]],
          books: list[list[int]], names: list[str], s: A.Settings, seed: int, store: SweepStore, world: _Dist,
          progress: bool | None) -> dict[str, Any]:
    """This rank's units: the batches (``k < len(batches)``), then the closed-book units ``books`` (their
    ``accuracy`` no-context rows only); unit k runs on rank ``k % world_size``."""
    units = batches + books
    done = store.done_batches()
    mine = [k for k in range(len(units)) if k % world.world == world.rank and k not in done]
    total = sum(len(batches[k]) for k in mine if k < len(batches))
    show = world.rank == 0 and (progress if progress is not None else True)
    bar = _progress(show, total, world.world)
    t = time.perf_counter()
    n_items = 0
    try:
        for k in mine:
            idx = units[k]
            rows = [rendered[i] for i in idx]
            nocontext = None if closed is None else [closed[i] for i in idx]
            batch = A.make_batch(model, rows, nocontext, [item_seed(seed, r.item.id) for r in rows], idx)
            if k >= len(batches):
                store.write_batch(k, {"accuracy": A.accuracy_closed_book(model, batch, s)}, batch.item_ids)
                continue
            store.write_batch(k, A.compute(model, batch, names, s, closed_book=not books), batch.item_ids)
            n_items += len(rows)
            if bar is not None:
                bar.update(len(rows))
    finally:
        if bar is not None:
            bar.close()
    return {"__rank_info__": dict(rank=world.rank, batches=len(mine), items=n_items,
                                  compute_s=round(time.perf_counter() - t, 3))}


def _manifest(fp: dict, read: Any, items: list[SweepItem], store: SweepStore, world: _Dist, model: Any, device: str,
              out: Any, data: Any, limit: int | None, tmpl: str, merged: dict[str, pd.DataFrame], wall: float,
              n_batches: int) -> dict:
    done = store.done_items(range(n_batches))
    return {
        "arguments": {**fp, "out": str(out), "device": device},
        "versions": _versions(),
        "model": {"id": model.cfg.model_name, "family": model.cfg.family, "config_sha256_16": fp["config_hash"],
                  "n_layers": model.cfg.n_layers, "n_heads": model.cfg.n_heads},
        "template": tmpl,
        "data": {"path": str(data), "lines_read": len(read.items) + len(read.skipped), "items": len(read.items),
                 "selected": len(items)},
        "items_done": len(done),
        "items_skipped": len(read.skipped),
        "skipped": read.skipped[:1000],
        "world_size": world.world,
        "ranks": store.rank_infos(),
        "tables": {name: len(df) for name, df in merged.items()},
        "wall_s": round(wall, 3),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _read_tables(root: Path, names: list[str]) -> dict[str, pd.DataFrame]:
    out = {}
    for p in sorted(root.glob("*.parquet")):
        out[p.stem] = pd.read_parquet(p)
    return out
