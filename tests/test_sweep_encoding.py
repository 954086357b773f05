"""The sweep's item reader on files that are not clean UTF-8 jsonl (issue 32 E): a Latin-1 line, invalid json, a BOM,
blank lines and CRLF endings. A bad line raises one typed `InputError` naming the file and the line, or with
`skip_bad` is recorded with its reason (what `skipped.parquet` holds); good lines around it are read."""

from __future__ import annotations

import pytest

from mdm_lens import sweep
from mdm_lens.errors import InputError

GOOD = '{"id": "a", "prompt": "hello"}'


def _file(tmp_path, data: bytes):
    path = tmp_path / "items.jsonl"
    path.write_bytes(data)
    return path


def test_a_latin1_line_is_a_typed_error_naming_file_and_line(tmp_path):
    path = _file(tmp_path, (GOOD + "\n" + '{"id": "b", "prompt": "caf\xe9"}' + "\n").encode("latin-1"))
    with pytest.raises(InputError) as err:
        sweep.read_items(path)
    msg = str(err.value)
    assert f"{path}:2:" in msg and "not UTF-8 (byte 0xe9 at byte 27 of the line" in msg
    assert not isinstance(err.value, UnicodeDecodeError)


def test_skip_bad_records_the_latin1_line_and_keeps_the_others(tmp_path):
    data = (GOOD + "\n" + '{"id": "b", "prompt": "caf\xe9"}' + "\n" + '{"id": "c", "prompt": "x"}\n').encode("latin-1")
    read = sweep.read_items(_file(tmp_path, data), skip_bad=True)
    assert [i.id for i in read.items] == ["a", "c"]
    assert read.skipped == [{"line": 2, "reason": "not UTF-8 (byte 0xe9 at byte 27 of the line; re-save the file "
                                                   "as UTF-8)"}]


def test_bom_crlf_and_blank_lines_are_read(tmp_path):
    data = b"\xef\xbb\xbf" + GOOD.encode() + b"\r\n\r\n   \r\n" + '{"id": "b", "prompt": "caf\xe9"}'.encode() + b"\r\n"
    read = sweep.read_items(_file(tmp_path, data))
    assert [(i.id, i.prompt, i.line) for i in read.items] == [("a", "hello", 1), ("b", "caf\xe9", 4)]
    assert read.skipped == []


def test_a_bom_inside_the_file_and_invalid_json_are_bad_lines(tmp_path):
    data = GOOD.encode() + b"\n\xef\xbb\xbf" + b'{"id": "b", "prompt": "x"}\n{"id": "c",\n'
    read = sweep.read_items(_file(tmp_path, data), skip_bad=True)
    assert [i.id for i in read.items] == ["a"]
    assert [s["line"] for s in read.skipped] == [2, 3]
    assert all(s["reason"].startswith("not valid json") for s in read.skipped)
    with pytest.raises(InputError, match=r"items.jsonl:2: not valid json"):
        sweep.read_items(tmp_path / "items.jsonl")
