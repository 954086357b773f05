"""The HTML outline of the reports (stdlib html.parser): exactly one h1, sections h2, sub-sections below them
with no skipped level, every image with a non-empty alt, every table header cell with a scope."""

from html.parser import HTMLParser

import pandas as pd
import pytest
from test_report_claims import planted  # noqa: F401 (fixture)

from mdm_lens.views import sweep_report as SR
from mdm_lens.views.report import Section, markdown_lite, write_report


class _Outline(HTMLParser):
    def __init__(self):
        super().__init__()
        self.levels, self.alts, self.th_scopes, self.iframes = [], [], [], 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if len(tag) == 2 and tag[0] == "h" and tag[1].isdigit():
            self.levels.append(int(tag[1]))
        elif tag == "img":
            self.alts.append((a.get("alt") or "").strip())
        elif tag == "th":
            self.th_scopes.append(a.get("scope"))


def outline(path):
    p = _Outline()
    p.feed(path.read_text(encoding="utf-8"))
    return p


def check(p):
    assert p.levels.count(1) == 1 and p.levels[0] == 1, p.levels
    for before, after in zip(p.levels, p.levels[1:]):
        assert after <= before + 1, f"skipped a heading level: h{before} -> h{after} in {p.levels}"
    assert 2 in p.levels
    assert all(p.alts), p.alts
    assert p.th_scopes and all(s in ("col", "row") for s in p.th_scopes), p.th_scopes


def test_sweep_report_outline(planted, tmp_path):  # noqa: F811
    p = outline(SR.report(planted, out=tmp_path / "r"))
    check(p)
    assert p.alts                                                     # the planted sweeps draw figures


def test_markdown_headings_start_below_the_section_and_never_skip():
    assert markdown_lite("## Only deep\n\ntext") == "<h3>Only deep</h3>\n<p>text</p>"
    html = markdown_lite("### a\n\n# b\n\n### c\n\n## d")
    assert [int(t[2]) for t in html.split("\n") if t.startswith("<h")] == [3, 3, 4, 4]


def test_written_report_outline_with_markdown_figures_and_tables(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure()
    fig.subplots().plot([0, 1])
    fig.savefig(tmp_path / "plot.png")
    table = pd.DataFrame({"a": [1, 2]}, index=pd.Index(["x", "y"], name="row"))
    secs = [Section("One", "### deep first\n\ntext\n\n# then top", [tmp_path / "plot.png"], table=table),
            Section("Two", "## sub", [(tmp_path / "plot.png", "")])]
    p = outline(write_report(tmp_path / "r", "Title", secs, meta={"model": "m"}))
    check(p)
    assert p.levels == [1, 2, 3, 3, 2, 3]
    assert p.alts == ["One: figure plot", "Two: figure plot"]
    assert p.th_scopes.count("row") >= 3                            # 2 index cells + the meta key


def test_a_standalone_view_page_has_one_h1():
    from mdm_lens.views.circuits_html import to_html

    p = _Outline()
    p.feed(to_html("<div>view</div>", title="Attention <L0>"))
    assert p.levels == [1]
    assert "<h1>Attention &lt;L0&gt;</h1>" in to_html("<div>view</div>", title="Attention <L0>")
