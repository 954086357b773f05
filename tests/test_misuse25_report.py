"""Held-out misuse25 S1: `mdm-lens report` over a folder of sweeps merged one model's sweeps of one data file
whatever their settings (a `--steps 1` sweep beside a `--steps 4` one became one "tiny-mdm", the other dropped with
"left out none"), and a copy whose table was damaged was hidden behind the good copy. Folders are one sweep only
when model, data and resolved settings agree; a folder with an unreadable table is left out with its reason."""

from __future__ import annotations

import re
import shutil

import pandas as pd
import pytest

from mdm_lens import sweep
from mdm_lens.errors import InputError
from mdm_lens.views.sweep_report import find_sweeps, report
from mdm_lens.zoo import jsonl

RERUN = "; rerun the sweep into a fresh folder, or remove the file"


@pytest.fixture(scope="module")
def built(mdm, tmp_path_factory):
    """Sweeps of the tiny MDM on one 4-item file: accuracy and absorption at the default settings (steps 4),
    accuracy at steps 1 / seed 1 / padded batching with batch size 2 and 1."""
    root = tmp_path_factory.mktemp("m25")
    data = root / "items.jsonl"
    jsonl.export(data, 4, seed=0)
    runs = {"s4": dict(probes="accuracy"), "s4b": dict(probes="absorption", limit=2, batch_size=1),
            "s1": dict(probes="accuracy", steps=1), "seed1": dict(probes="accuracy", seed=1),
            "pad2": dict(probes="accuracy", batching="padded", batch_size=2),
            "pad1": dict(probes="accuracy", batching="padded", batch_size=1)}
    for name, kw in runs.items():
        sweep.run(mdm, data, kw.pop("probes"), root / "built" / name, progress=False, **kw)
    return root / "built"


def _folder(built, tmp_path, names):
    for name in names:
        shutil.copytree(built / name, tmp_path / "sweeps" / name)
    return tmp_path / "sweeps"


def _header(html, key):
    return re.search(rf'<th scope="row" class="k">{key}</th><td class="v">(.*?)</td>', html).group(1)


def _shape(sweeps):
    return [(s.label, [r.name for r in s.roots], s.n_items) for s in sweeps]


def test_sweeps_of_other_steps_are_reported_apart_and_complementary_folders_still_merge(built, tmp_path):
    folder = _folder(built, tmp_path, ["s1", "s4", "s4b"])
    sweeps, left = find_sweeps(folder)
    assert left == []
    # s4 + s4b: the same settings, other probes (and fewer items): one sweep, as before
    assert _shape(sweeps) == [("tiny-mdm (s1; steps 1)", ["s1"], 4), ("tiny-mdm (s4, s4b; steps 4)", ["s4", "s4b"], 4)]
    s1, s4 = sweeps
    assert s1.probes == ["accuracy"] and s4.probes == ["accuracy", "absorption"]
    pd.testing.assert_frame_equal(s1.table("accuracy"), pd.read_parquet(folder / "s1" / "accuracy.parquet"),
                                  check_dtype=False)
    pd.testing.assert_frame_equal(s4.table("accuracy"), pd.read_parquet(folder / "s4" / "accuracy.parquet"),
                                  check_dtype=False)
    assert s1.table("absorption") is None and len(s4.table("absorption").item_id.unique()) == 2
    html = report(folder, out=tmp_path / "r").read_text()
    assert _header(html, "sweeps") == "tiny-mdm (s1; steps 1) (4 items), tiny-mdm (s4, s4b; steps 4) (4 items)"
    assert _header(html, "left out") == "none"
    assert _header(html, "canvas") == ("tiny-mdm (s1; steps 1): gen_length 4, steps 1; "
                                       "tiny-mdm (s4, s4b; steps 4): gen_length 4, steps 4")


def test_another_seed_is_another_sweep(built, tmp_path):
    sweeps, left = find_sweeps(_folder(built, tmp_path, ["s4", "seed1"]))
    assert left == [] and _shape(sweeps) == [("tiny-mdm (s4; seed 0)", ["s4"], 4),
                                             ("tiny-mdm (seed1; seed 1)", ["seed1"], 4)]


def test_the_batch_size_splits_sweeps_only_where_it_decides_rows(built, tmp_path):
    # batching "length": rows are the item's alone whatever the batch size (s4 ran 8, s4b 1): complementary;
    # batching "padded": the batch's padding changes rows (fp32 rounding), so sizes 2 and 1 are two sweeps
    sweeps, left = find_sweeps(_folder(built, tmp_path, ["pad1", "pad2", "s4", "s4b"]))
    assert left == []
    assert _shape(sweeps) == [("tiny-mdm (pad1; batch_size 1, batching padded)", ["pad1"], 4),
                              ("tiny-mdm (pad2; batch_size 2, batching padded)", ["pad2"], 4),
                              ("tiny-mdm (s4, s4b; batching length)", ["s4", "s4b"], 4)]


@pytest.mark.parametrize("bad", ["a", "b"])
@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_an_unreadable_copy_is_left_out_with_its_reason_not_hidden_behind_a_good_one(built, tmp_path, bad, damage):
    for name in ("a", "b"):
        shutil.copytree(built / "s4", tmp_path / "sweeps" / name)
    path = tmp_path / "sweeps" / bad / "accuracy.parquet"
    path.write_bytes(path.read_bytes()[:100] if damage == "truncated" else b"garbage")
    sweeps, left = find_sweeps(tmp_path / "sweeps")
    good = "b" if bad == "a" else "a"
    assert _shape(sweeps) == [("tiny-mdm", [good], 4)]
    [(name, why)] = left
    assert name == bad and why.startswith("accuracy.parquet is not a readable table (ArrowInvalid: ") \
        and why.endswith(RERUN)
    html = report(tmp_path / "sweeps", out=tmp_path / "r").read_text()
    assert _header(html, "left out").startswith(f"{bad}: accuracy.parquet is not a readable table (ArrowInvalid: ")
    # alone it is an error, as it is as the only sweep of a folder
    with pytest.raises(InputError, match=f"{bad} is not a usable sweep: accuracy.parquet is not a readable "
                                         r"table \(ArrowInvalid: ") as e:
        find_sweeps(tmp_path / "sweeps" / bad)
    assert e.value.argument == "folder" and e.value.value == str(tmp_path / "sweeps" / bad)
    shutil.rmtree(tmp_path / "sweeps" / good)
    with pytest.raises(InputError, match=f"no finished sweep subfolders \\(left out: {bad}: accuracy.parquet is not"):
        find_sweeps(tmp_path / "sweeps")


def test_a_copy_whose_table_lost_its_value_column_is_left_out(built, tmp_path):
    folder = _folder(built, tmp_path, ["s4", "s4b"])
    pd.DataFrame({"item_id": ["a"], "layer": [0]}).to_parquet(folder / "s4b" / "accuracy.parquet")
    sweeps, left = find_sweeps(folder)
    assert _shape(sweeps) == [("tiny-mdm", ["s4"], 4)]
    assert left == [("s4b", "accuracy.parquet has no 'value' column (columns: ['item_id', 'layer']): not a table "
                            "this sweep wrote")]
