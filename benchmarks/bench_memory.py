"""Item 4: memory of a trajectory with streaming `ReceivedAttention()` vs caching every layer's full
pattern at every step (`TrajectoryCache("blocks.*.attn.hook_pattern")`).

Two measures, both in this process:
* held: the bytes of the tensors the run returns (`out.records` vs the cached patterns), exact;
* peak: the peak of bytes allocated through the C allocator while the call runs, above the level
  just before it (glibc `mallinfo2()`: in-use arena + mmapped bytes, which is where torch's CPU
  allocator gets its memory; sampled every ~1 ms by a thread, so spikes shorter than that are
  missed). Python's `tracemalloc` cannot see torch tensors, so it is not used. Falls back to RSS
  where `mallinfo2` is missing.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from typing import Any

from benchmarks.harness import Row, human_bytes, markdown_table, seconds
from benchmarks.models import Size, Workspace, hf_llama, random_tokens


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


def _allocated_reader():
    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
        fn.restype = _MallInfo2

        def read() -> int:
            m = fn()
            return m.uordblks + m.hblkhd
        read()
        return read, "glibc mallinfo2 (allocated bytes)"
    except (OSError, AttributeError):
        page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

        def read_rss() -> int:
            try:
                with open("/proc/self/statm") as f:
                    return int(f.read().split()[1]) * page
            except OSError:
                return 0
        return read_rss, "resident set size"


READ, METHOD = _allocated_reader()


class Peak:
    """`with Peak() as p: …` → `p.bytes`: the peak allocation above the level at entry."""

    def __init__(self, interval: float = 0.001):
        self.interval = interval

    def __enter__(self) -> "Peak":
        self.base = READ()
        self.peak = self.base
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, READ())
            time.sleep(self.interval)

    def __exit__(self, *exc: Any) -> None:
        self.peak = max(self.peak, READ())
        self._stop.set()
        self._t.join()
        self.bytes = self.peak - self.base


def _held(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def run(size: Size, ws: Workspace, repeats: int) -> tuple[list[Row], list[str]]:
    from mdm_lens import ReceivedAttention, TrajectoryCache

    hf = hf_llama(size, attn="sdpa")
    ours = ws.ours(hf)
    del hf
    L, H, S = size.n_layers, size.n_heads, size.steps
    table, rows = [], []
    base_stream = base_full = None
    for T in size.mem_seqs:
        prompt = random_tokens(size, T - S, seed=3)
        kw = dict(steps=S, gen_length=S, block_length=S, progress=False)
        ours.generate(prompt, record=[ReceivedAttention()], **kw)  # warm-up at this length
        with Peak() as ps:
            t0 = time.perf_counter()
            out_s = ours.generate(prompt, record=[ReceivedAttention()], **kw)
            ts = time.perf_counter() - t0
        held_s = _held(out_s.records.values())
        del out_s
        need = S * L * H * T * T * 4
        cache = TrajectoryCache("blocks.*.attn.hook_pattern", budget_bytes=2 * need + 2**20)
        with Peak() as pf:
            t0 = time.perf_counter()
            out_f = ours.generate(prompt, cache=cache, **kw)
            tf = time.perf_counter() - t0
        held_f = _held(t for s in out_f.cache.steps for t in out_f.cache[s].cache_dict.values())
        del out_f, cache
        pred_s, pred_f = S * L * H * T * 4, need
        base_stream = base_stream or held_s
        base_full = base_full or held_f
        table.append([str(T), human_bytes(held_s), f"{held_s / pred_s:.2f}", f"{held_s / base_stream:.1f}×",
                      human_bytes(ps.bytes), seconds(ts), human_bytes(held_f), f"{held_f / pred_f:.2f}",
                      f"{held_f / base_full:.1f}×", human_bytes(pf.bytes), seconds(tf)])
        if T == size.mem_seqs[-1]:
            rows.append(Row("4 memory", f"peak, streaming vs full-pattern cache, {size.label()}, T={T}, {S} steps",
                            human_bytes(ps.bytes), human_bytes(pf.bytes), ps.bytes / max(pf.bytes, 1), "—", None,
                            f"peak {METHOD}, sampled"))
            rows.append(Row("4 memory", f"held, streaming vs full-pattern cache, T={T}", human_bytes(held_s),
                            human_bytes(held_f), held_s / held_f, "—", None, f"= 1/T = {1 / T:.4f} expected"))
    header = ["T", "stream held", "÷ S·L·H·T·4", "growth", "stream peak", "time", "full held", "÷ S·L·H·T²·4",
              "growth", "full peak", "time"]
    sec = (f"Memory (item 4), {size.label()}, {S} steps, gen_length {S}, fp32. *held* = bytes of the returned "
           f"tensors (records vs cached patterns); *peak* = peak {METHOD} above the level before the call, "
           "sampled every ~1 ms (includes the held tensors and the transient activations of one forward). "
           "The ÷ columns divide by the predicted size (1.00 = exactly steps·layers·heads·T resp. ·T², 4 bytes "
           "each); growth is relative to the smallest T.\n\n" + markdown_table(header, table))
    return rows, [sec]
