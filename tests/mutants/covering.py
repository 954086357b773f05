"""Which tests execute which source lines: a per-test coverage map, so a mutant runs only the tests that
reach the line it changes (the rest of the suite cannot catch it). Built once per tree with pytest-cov's
per-test contexts (`pip install pytest-cov`; not a CI dependency: mutation testing is not part of CI)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def build_map(root: Path, out: Path, pytest_args: list[str] = ()) -> dict[str, dict[str, list[str]]]:
    """Run the whole suite once under coverage with one context per test; write `{file: {line: [node ids]}}`."""
    try:
        import coverage  # noqa: F401
        import pytest_cov  # noqa: F401
    except ImportError as e:  # a plain message, not a traceback: this tool is optional
        raise SystemExit(f"covering tests need pytest-cov (pip install pytest-cov): {e}")
    data_file = out.with_suffix(".coverage")
    env = dict(os.environ, MPLBACKEND="Agg", HF_HUB_OFFLINE="1", COVERAGE_FILE=str(data_file))
    # pass or fail, the map is what matters (a failing suite is reported by the baseline run)
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--cov=mdm_lens",
                    "--cov-context=test", "--cov-report=", "--ignore=tests/test_mutants_catalogue.py",
                    *pytest_args], cwd=root, env=env)
    import coverage

    data = coverage.CoverageData(basename=str(data_file))
    data.read()
    table: dict[str, dict[str, list[str]]] = {}
    for path in data.measured_files():
        rel = os.path.relpath(path, root)
        by_line = data.contexts_by_lineno(path)
        # coverage's context is "<node id>|run" (or |setup, |teardown): split at the LAST bar, since a parametrize
        # id may hold one itself ("int32|I32"), which a first-bar split cut into a test id pytest cannot find
        table[rel] = {str(n): sorted({c.rsplit("|", 1)[0] for c in ctx if c}) for n, ctx in by_line.items()}
    out.write_text(json.dumps(table))
    return table


def snippet_lines(text: str, find: str) -> range:
    """1-based line numbers the (unique) snippet spans in `text`."""
    start = text.index(find)
    first = text.count("\n", 0, start) + 1
    return range(first, first + find.count("\n") + 1)


def covering_tests(table: dict, file: str, text: str, find: str) -> list[str] | None:
    """Node ids of the tests that execute any line of the snippet; [] when no test reaches it; None when the lines
    run only at import (module-level tables and defaults: coverage gives them no test context, so any test that
    imports the module may depend on them)."""
    lines = table.get(file, {})
    ids: set[str] = set()
    imported_only = False
    for n in snippet_lines(text, find):
        got = [i for i in lines.get(str(n), ()) if "::" in i]
        ids.update(got)
        imported_only |= str(n) in lines and not got
    if not ids and imported_only:
        return None
    return sorted(ids)
