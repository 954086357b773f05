"""Mutation testing: plant each curated bug in a scratch copy of the repo, run the suite, report what survives.

    python -m tests.mutants                 # every mutant, 2 workers
    python -m tests.mutants --list          # the catalogue
    python -m tests.mutants --only dream-entropy-sign llada-cfg-direction
    python -m tests.mutants --jobs 1 --timeout 300 --json out.json
    python -m tests.mutants --from-json blind.json --covering map.json   # a held-out list, covering tests only

`--from-json` reads mutants written by someone who has not read tests/ (a list of {id, file, find, replace,
note}); `--covering MAP` runs each mutant on the tests that execute a line it changes (per-test coverage, built
into MAP on first use: tests/mutants/covering.py; a test that never executes a line cannot catch its mutant);
`--confirm` reruns each survivor on the whole suite.

A mutant is *caught* when the suite fails on it (pytest exit 1) and *survives* when the suite passes; a run
that hits `--timeout` is reported as *timed out* (an infinite loop, or tests too slow to tell), never as caught. A mutant whose snippet no longer occurs exactly once is
*stale* and makes the run fail, so the catalogue cannot silently rot (tests/test_mutants_catalogue.py checks
this in CI without running the suite). Not part of CI's default run: it takes minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from tests.mutants.catalogue import MUTANTS, Mutant
from tests.mutants.covering import build_map, covering_tests

ROOT = Path(__file__).resolve().parents[2]


def load_mutants(path: Path) -> list[Mutant]:
    rows = json.loads(path.read_text())
    return [Mutant(r["id"], r.get("area", "blind"), r["file"], r["find"], r["replace"], r.get("note", ""))
            for r in rows]


def check_catalogue(root: Path = ROOT, mutants: list[Mutant] | None = None) -> list[str]:
    """Problems with the catalogue: unknown files, snippets that are missing or occur more than once, no-ops."""
    problems, seen = [], set()
    for m in MUTANTS if mutants is None else mutants:
        if m.id in seen:
            problems.append(f"{m.id}: duplicate id")
        seen.add(m.id)
        path = root / m.file
        if not path.is_file():
            problems.append(f"{m.id}: no file {m.file}")
            continue
        count = path.read_text().count(m.find)
        if count != 1:
            problems.append(f"{m.id}: snippet occurs {count} times in {m.file} (must be exactly once)")
        if m.find == m.replace:
            problems.append(f"{m.id}: replacement equals the original")
    return problems


def _copy_repo(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    for name in files:
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def _with_covering(m: Mutant, table: dict) -> Mutant:
    """`m` restricted to the tests that execute a line of its snippet; none: it survives without a run."""
    text = (ROOT / m.file).read_text()
    if not m.file.endswith(".py"):  # coverage sees Python only: an asset's tests are those that name its stem
        stem = Path(m.file).stem
        ids = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py") if stem in p.read_text())
        return replace(m, tests=tuple(ids) if ids else ("<uncovered>",))
    ids = covering_tests(table, m.file, text, m.find)
    if ids is None:  # module-level lines: the test files that import the module
        module = m.file.removesuffix(".py").replace("/", ".")
        stem = module.rsplit(".", 1)[-1]
        ids = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                     if module in (t := p.read_text()) or f"import {stem}" in t) or ["tests"]
    return replace(m, tests=tuple(ids) if ids else ("<uncovered>",))


def run_one(m: Mutant | None, workdir: Path, timeout: float, pytest_args: list[str]) -> dict:
    """Run the suite on `workdir` with `m` planted (None: the unmutated baseline)."""
    m = m or Mutant("baseline", "-", "README.md", "", "", "the unmutated tree")
    if m.tests == ("<uncovered>",):
        return dict(id=m.id, area=m.area, file=m.file, status="survived", seconds=0.0,
                    tail=["no test executes the mutated lines"], note=m.note)
    path = workdir / m.file
    original = path.read_text()
    if m.find:
        path.write_text(original.replace(m.find, m.replace, 1))
    env = dict(os.environ, PYTHONPATH=str(workdir), MPLBACKEND="Agg", HF_HUB_OFFLINE="1",
               PYTHONDONTWRITEBYTECODE="1")
    start = time.time()
    try:
        # the catalogue check fails by construction on a mutated tree: leave it out
        proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                               "--ignore=tests/test_mutants_catalogue.py", *(m.tests or ("tests",)), *pytest_args],
                              cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout)
        code, tail = proc.returncode, (proc.stdout + proc.stderr).strip().splitlines()[-3:]
    except subprocess.TimeoutExpired:
        code, tail = -1, ["time-out"]
    finally:
        path.write_text(original)
    # a time-out is not a catch: the mutant's tests did not finish (slow, or an infinite loop) — reported apart
    status = "survived" if code == 0 else "caught" if code == 1 else "timed out" if code == -1 else f"error (exit {code})"
    return dict(id=m.id, area=m.area, file=m.file, status=status, seconds=round(time.time() - start, 1),
                tail=tail, note=m.note)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.mutants", description=__doc__.splitlines()[0])
    ap.add_argument("--list", action="store_true", help="print the catalogue and exit")
    ap.add_argument("--only", nargs="*", default=None, help="mutant ids to run")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per mutant")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--from-json", type=Path, default=None, help="mutants from this file, not the catalogue")
    ap.add_argument("--confirm", action="store_true",
                    help="with --covering: rerun each survivor on the whole suite (a fresh map makes this redundant)")
    ap.add_argument("--skip-baseline", action="store_true", help="trust that the unmutated suite passes")
    ap.add_argument("--covering", type=Path, default=None,
                    help="per-test coverage map (built here if missing): run only the tests reaching each mutant")
    args, pytest_args = ap.parse_known_args(argv)
    catalogue = load_mutants(args.from_json) if args.from_json else MUTANTS
    if args.list:
        for m in catalogue:
            print(f"{m.id:34s} {m.area:10s} {m.file}: {m.note}")
        return 0
    problems = check_catalogue(mutants=catalogue)
    if problems:
        print("stale catalogue:\n  " + "\n  ".join(problems))
        if not args.from_json:
            return 2
        bad = {p.split(":")[0] for p in problems}  # a held-out list: run what applies, report the rest
        catalogue = [m for m in catalogue if m.id not in bad]
    if args.covering:
        table = json.loads(args.covering.read_text()) if args.covering.exists() else build_map(ROOT, args.covering)
        catalogue = [_with_covering(m, table) for m in catalogue]
    chosen = catalogue if not args.only else [m for m in catalogue if m.id in set(args.only)]
    unknown = set(args.only or ()) - {m.id for m in catalogue}
    if unknown:
        print(f"unknown mutant ids: {sorted(unknown)}")
        return 2
    with tempfile.TemporaryDirectory(prefix="mdm-mutants-") as tmp:
        dirs = []
        for j in range(max(1, args.jobs)):
            d = Path(tmp) / f"w{j}"
            d.mkdir()
            _copy_repo(d)
            dirs.append(d)
        free = list(dirs)
        base = dict(status="survived", seconds=0.0) if args.skip_baseline else \
            run_one(None, dirs[0], args.timeout, pytest_args)
        if base["status"] != "survived":  # the suite must pass before a failure can mean "caught"
            print(f"the unmutated suite does not pass: {base['tail']}")
            return 2
        print(f"  baseline  {base['seconds']:6.1f}s  (suite passes unmutated)", flush=True)

        def task(m: Mutant) -> dict:
            d = free.pop()
            try:
                r = run_one(m, d, args.timeout, pytest_args)
            finally:
                free.append(d)
            print(f"  {r['status']:9s} {r['seconds']:6.1f}s  {m.id}", flush=True)
            return r

        with ThreadPoolExecutor(max_workers=len(dirs)) as pool:
            results = list(pool.map(task, chosen))
            if args.covering and args.confirm:  # a survivor of its covering tests must survive the whole suite too
                again = [replace(m, tests=()) for m, r in zip(chosen, results)
                         if r["status"] == "survived" and m.tests != ("<uncovered>",)]
                confirmed = {r["id"]: r for r in pool.map(task, again)}
                results = [confirmed.get(r["id"], r) for r in results]
    caught = sum(r["status"] == "caught" for r in results)
    timed_out = [r for r in results if r["status"] == "timed out"]
    survivors = [r for r in results if r["status"] == "survived"]
    errors = [r for r in results if r["status"].startswith("error")]
    score = caught / max(1, len(results))
    print(f"\n{caught} of {len(results)} mutants caught ({100 * score:.1f}%)")
    for r in survivors:
        print(f"  SURVIVED {r['id']} ({r['file']}): {r['note']}")
    for r in timed_out:
        print(f"  TIMED OUT {r['id']} ({r['file']}): {r['note']}")
    for r in errors:
        print(f"  ERROR    {r['id']}: {r['status']} {r['tail']}")
    if args.json:
        args.json.write_text(json.dumps(dict(score=score, results=results), indent=1))
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
