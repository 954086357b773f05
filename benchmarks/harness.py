"""Timing and reporting: paired, alternating runs in one process, medians, a markdown table.

Ratios are `ours / theirs` (lower is better for time and memory; for the speed-up rows the table
says so). A ratio is the median over rounds of the per-round ratio `t_ours[r] / t_theirs[r]`, where
round r runs A then B back to back: pairing cancels most of the slow drift of a shared machine.
"""

from __future__ import annotations

import gc
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class Row:
    bench: str  # "1 forward", "2 patterns", ...
    case: str  # what is compared
    ours: str  # the ours column (seconds or bytes, formatted)
    theirs: str
    ratio: float  # ours / theirs unless `speedup`
    target: str  # e.g. "≤ 1.05"
    met: bool | None
    note: str = ""
    speedup: bool = False  # ratio is theirs / ours (a speed-up)

    def cells(self) -> list[str]:
        verdict = "—" if self.met is None else ("yes" if self.met else "**no**")
        r = f"{self.ratio:.1f}×" if self.speedup else f"{self.ratio:.3f}"
        return [self.bench, self.case, self.ours, self.theirs, r, self.target, verdict, self.note]


HEADER = ["bench", "case", "ours", "theirs", "ratio", "target", "met", "note"]


@dataclass
class Timing:
    a: list[float]
    b: list[float]
    ratios: list[float] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)

    @property
    def a_med(self) -> float:
        return statistics.median(self.a)

    @property
    def b_med(self) -> float:
        return statistics.median(self.b)

    @property
    def min_ratio(self) -> float:
        """min(t_A) / min(t_B): the least disturbed run of each side (contention only adds time)."""
        return min(self.a) / min(self.b)

    def spread(self) -> str:
        """Interquartile range of the per-round ratios (min–max below 4 rounds) and the ratio of minima."""
        r = sorted(self.ratios)
        if len(r) < 4:
            return f"{len(r)} round(s), range {r[0]:.3f}–{r[-1]:.3f}"
        q = statistics.quantiles(r, n=4)
        return f"{len(r)} rounds, IQR {q[0]:.3f}–{q[2]:.3f}, min/min {self.min_ratio:.3f}"


def _timed(fn: Callable[[], object]) -> float:
    gc.collect()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def alternate(a: Callable[[], object], b: Callable[[], object], repeats: int, warmup: int = 1) -> Timing:
    """Warm both up, then run A, B, A, B, … `repeats` rounds; per-round ratios t_A / t_B."""
    for _ in range(warmup):
        a()
        b()
    ta, tb = [], []
    for _ in range(max(1, repeats)):
        ta.append(_timed(a))
        tb.append(_timed(b))
    return Timing(ta, tb, [x / y for x, y in zip(ta, tb)])


def seconds(t: float) -> str:
    return f"{t * 1e3:.1f} ms" if t < 1 else f"{t:.2f} s"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
    return "\n".join(lines)


def plain_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*r) for r in rows]
    return "\n".join(out)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _version(module: str) -> str:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:
        return "not installed"


def machine_info() -> dict[str, str]:
    return {
        "date (UTC)": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "machine": f"{_cpu_model()}, {os.cpu_count()} logical CPUs visible, {platform.machine()}",
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch threads": str(torch.get_num_threads()),
        "transformers": _version("transformers"),
        "transformer-lens": _version("transformer-lens"),
        "nnsight": _version("nnsight"),
        "mdm-lens": _version("mdm-lens"),
        "load average at start": " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a",
    }
