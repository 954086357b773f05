"""`mdm-lens` command line: wrong counts, an `--out` that is a file or a folder, and impossible `zoo export`
combinations are one-line errors with exit code 2 (never a traceback); a good export writes its items."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mdm_lens import cli

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def items(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "items.jsonl"
    assert cli.main(["zoo", "export", "--n", "3", "--seed", "34", "--out", str(path)]) == 0
    return path


def _sweep(items, out, *extra):
    return ["sweep", "--model", "mdm-lens/tiny-mdm", "--data", str(items), "--probes", "absorption", "--out", str(out),
            "--no-progress", *extra]


def _one_line_error(capsys, argv, expected):
    try:
        rc = cli.main(argv)
    except SystemExit as e:           # argparse's usage errors leave parse_args this way
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert expected in err, err


def test_good_export_writes_the_items(items):
    lines = [json.loads(x) for x in items.read_text().splitlines()]
    assert [x["id"] for x in lines] == ["zoo-34-00000", "zoo-34-00001", "zoo-34-00002"]


@pytest.mark.parametrize("extra, expected", [
    (["--limit", "-1"], "error: --limit=-1 is invalid: expected an int >= 1."),
    (["--limit", "0"], "error: --limit=0 is invalid: expected an int >= 1."),
    (["--batch-size", "-4"], "error: --batch-size=-4 is invalid: expected an int >= 1."),
    (["--steps", "-2"], "error: --steps=-2 is invalid: expected an int >= 1."),
    (["--gen-length", "0"], "error: --gen-length=0 is invalid"),
    (["--seed", "-1"], "error: --seed=-1 is invalid: expected an int >= 0."),
    (["--keep-keys", "-1"], "error: --keep-keys=-1 is invalid"),
    (["--max-passages", "0"], "error: --max-passages=0 is invalid"),
    (["--batch-size", "abc"], "mdm-lens sweep: error: argument --batch-size: invalid int value: 'abc' (see --help)"),
    (["--probes", "absorption,attention"], "error: probes='attention' is invalid"),
])
def test_sweep_bad_counts_are_one_line_errors(capsys, items, tmp_path, extra, expected):
    _one_line_error(capsys, _sweep(items, tmp_path / "o", *extra), expected)
    assert not (tmp_path / "o").exists()


def test_sweep_out_that_is_a_file(capsys, items):
    _one_line_error(capsys, _sweep(items, items), "is a file, not a folder")


@pytest.mark.parametrize("args, expected", [
    (["--n", "-1"], "error: --n=-1 is invalid: expected an int >= 1."),
    (["--n", "0"], "error: --n=0 is invalid"),
    (["--n", "2", "--seed", "-3"], "error: --seed=-3 is invalid"),
    (["--n", "2", "--n-distractors", "-1"], "error: --n-distractors=-1 is invalid: expected an int in [0, 19]."),
    (["--n", "2", "--n-distractors", "25"], "error: --n-distractors=25 is invalid"),
    (["--n", "2", "--n-distractors", "2", "--gold-position", "3"],
     "error: --gold-position=3 is invalid: expected an int in [-3, 2]."),
    (["--n", "2", "--n-distractors", "2", "--gold-position", "-4"], "error: --gold-position=-4 is invalid"),
    (["--n", "2", "--gold-position", "foo"], "argument --gold-position: 'foo' is neither an index nor one of"),
])
def test_zoo_export_bad_combinations_are_one_line_errors(capsys, tmp_path, args, expected):
    out = tmp_path / "x.jsonl"
    _one_line_error(capsys, ["zoo", "export", *args, "--out", str(out)], expected)
    assert not out.exists()


def test_zoo_export_out_that_is_a_folder(capsys, tmp_path):
    _one_line_error(capsys, ["zoo", "export", "--n", "2", "--out", str(tmp_path)], "is a folder")


def test_a_real_process_prints_one_line_and_exits_2(items, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-m", "mdm_lens.cli", *_sweep(items, tmp_path / "o", "--limit", "-5")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr == "error: --limit=-5 is invalid: expected an int >= 1.\n"
    assert not (tmp_path / "o").exists()
