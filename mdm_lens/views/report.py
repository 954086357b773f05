"""A portable, offline HTML report: figures, interactive views, tables and notes in one folder.

    from mdm_lens.views import Section, write_report
    index = write_report("runs/absorption", "Absorption: tiny MDM vs ARM",
                         [Section("Absorption by layer", "MDM absorbs **less** than its ARM twin.",
                                  images=["absorption.png"], table=df)],
                         meta={"model": "mdm-lens/tiny-mdm", "samples": 64})

Layout of `folder`: `index.html` plus `images/` holding a copy of every image. The links are relative,
so the folder can be zipped, moved or served as it is. Images already under `folder` are linked in
place. Nothing is fetched from the network. circuitsvis views are rendered from the local bundle,
which is inlined once in the page head however many views there are (see `circuits.to_html`). A
full HTML document passed in `html` goes into an `<iframe srcdoc>`. Writing the report prints nothing.
"""

from __future__ import annotations

import html as _html
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from mdm_lens import validate
from mdm_lens.errors import ArgumentTypeError
from mdm_lens.views import circuits

__all__ = ["Section", "write_report", "markdown_lite"]


@dataclass
class Section:
    """One report section. `text` is markdown-lite (see `markdown_lite`); text that starts with an HTML
    tag is inserted as it is. Each entry of `images` is a path or a `(path, caption)` pair. Each entry of
    `html` is an HTML string or a circuitsvis view. `table` is an optional DataFrame.
    `finding` closes the section: one sentence, computed from the numbers, of what was measured and shows.
    `claims` (a DataFrame: one row per comparison, the numbers the finding quotes) is shown above it and
    `absent` (one line per model left out of the section, with the reason) below the text."""

    title: str
    text: str = ""
    images: Sequence[Any] = field(default_factory=list)
    html: Sequence[Any] = field(default_factory=list)
    table: Any = None  # pandas.DataFrame | None
    table_caption: str = ""
    finding: str = ""  # one sentence computed from the numbers: what was measured and what it shows
    claims: Any = None  # pandas.DataFrame | None: the comparisons the finding states (Δ, interval, n, verdict)
    absent: Sequence[str] = field(default_factory=list)  # "model: why it is not in this section"


_CSS = """
:root{--fg:#1f2328;--muted:#59636e;--line:#d8dee4;--accent:#0072B2;--bg2:#f6f8fa}
*{box-sizing:border-box}
body{font:15px/1.55 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",sans-serif;color:var(--fg);
 margin:0;background:#fff}
main{max-width:1120px;margin:0 auto;padding:28px 32px 64px}
h1{font-size:26px;margin:0 0 6px}
h2{font-size:20px;margin:40px 0 10px;padding-top:10px;border-top:1px solid var(--line)}
h3{font-size:16px;margin:18px 0 6px} h4{font-size:15px;margin:14px 0 4px}
a{color:var(--accent);text-decoration:none} a:hover{text-decoration:underline}
.sub{color:var(--muted);margin-bottom:16px}
table.meta{border-collapse:collapse;margin:10px 0 18px;font-size:13px}
table.meta td,table.meta th{padding:3px 14px 3px 0;vertical-align:top}
table.meta .k{font-weight:normal;text-align:left;color:var(--muted);white-space:nowrap}
table.meta td.v{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
nav.toc{background:var(--bg2);border:1px solid var(--line);border-radius:6px;padding:10px 18px;margin:12px 0 8px}
nav.toc b{font-size:13px;color:var(--muted);text-transform:uppercase;letter-spacing:.04em}
nav.toc ol{margin:6px 0 2px;padding-left:22px} nav.toc li{margin:2px 0}
figure{margin:14px 0 18px;text-align:center}
figure img{max-width:100%;height:auto;border:1px solid var(--line);border-radius:4px}
figcaption{color:var(--muted);font-size:13px;margin-top:4px}
code{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:13px;background:var(--bg2);
 padding:1px 4px;border-radius:3px}
pre{background:var(--bg2);padding:10px 12px;border-radius:6px;overflow-x:auto;font-size:13px}
pre code{background:none;padding:0}
.tablewrap{overflow-x:auto;margin:12px 0}
table.data{border-collapse:collapse;font-size:13px;font-variant-numeric:tabular-nums}
table.data th,table.data td{border-bottom:1px solid var(--line);padding:4px 10px;text-align:right}
table.data th{background:var(--bg2);text-align:center}
table.data tbody th{white-space:nowrap}
table.data tbody tr:nth-child(even){background:#fbfbfc}
table.data td:first-child,table.data th:first-child{text-align:left}
.tcap{color:var(--muted);font-size:13px;margin-bottom:2px}
.absent{color:var(--muted);font-size:13px}
.finding{border-left:3px solid var(--accent);background:var(--bg2);padding:6px 12px;margin:12px 0}
.view{border:1px solid var(--line);border-radius:6px;padding:6px 10px;margin:14px 0;overflow-x:auto}
iframe.view{width:100%;height:480px;padding:0}
footer{color:var(--muted);font-size:12px;margin-top:48px;border-top:1px solid var(--line);padding-top:8px}
"""

_IFRAME_FIT = ("try{var d=this.contentDocument;if(d&&d.body){this.style.height=(d.documentElement.scrollHeight+24)"
               "+'px';}}catch(e){}")


def _inline(s: str) -> str:
    """Inline markdown on already-escaped text: `code`, **bold**, *italic*, [text](link)."""
    parts = re.split(r"(`[^`]+`)", s)
    out = []
    for p in parts:
        if len(p) >= 2 and p.startswith("`") and p.endswith("`"):
            out.append(f"<code>{p[1:-1]}</code>")
            continue
        p = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", p)
        p = re.sub(r"(?<![\w*])\*(?!\s)(.+?)(?<!\s)\*(?![\w*])", r"<i>\1</i>", p)
        p = re.sub(r"\[([^\]]+)\]\(([^)\s]+)\)",
                   lambda m: f'<a href="{m.group(2)}">{m.group(1)}</a>'
                   if not m.group(2).lower().startswith("javascript:") else m.group(1), p)
        out.append(p)
    return "".join(out)


def markdown_lite(text: str) -> str:
    """A small markdown subset: blank-line paragraphs, `#`/`##`/`###` headings (sub-headings of the section's h2:
    the shallowest one used is h3, each deeper one level below, never skipping one: `_outline`),
    `-`/`*` bullets, `1.` numbered lists, ``` fenced code, `code`, **bold**, *italic* and [links](x).
    Text that starts with an HTML tag is returned unchanged."""
    if not text:
        return ""
    if not isinstance(text, str):
        raise ArgumentTypeError(f"text={type(text).__name__} is not a str (markdown).", argument="text",
                                value=type(text).__name__, allowed="a str")
    if re.match(r"\s*<[a-zA-Z!/]", text):
        return text
    lines = text.replace("\r\n", "\n").split("\n")
    heading_level = _outline(lines)
    html: list[str] = []
    para: list[str] = []
    lst: str | None = None

    def flush_para():
        if para:
            html.append("<p>" + _inline(_html.escape(" ".join(x.strip() for x in para), quote=False)) + "</p>")
            para.clear()

    def close_list():
        nonlocal lst
        if lst:
            html.append(f"</{lst}>")
            lst = None

    i = 0
    while i < len(lines):
        line = lines[i]
        st = line.strip()
        if st.startswith("```"):
            flush_para(); close_list()
            j = i + 1
            code = []
            while j < len(lines) and not lines[j].strip().startswith("```"):
                code.append(lines[j]); j += 1
            html.append("<pre><code>" + _html.escape("\n".join(code), quote=False) + "</code></pre>")
            i = j + 1
            continue
        m_h = re.match(r"(#{1,3})\s+(.*)", st)
        m_ul = re.match(r"[-*]\s+(.*)", st)
        m_ol = re.match(r"\d+[.)]\s+(.*)", st)
        if not st:
            flush_para(); close_list()
        elif m_h:
            flush_para(); close_list()
            level = heading_level(len(m_h.group(1)))
            html.append(f"<h{level}>{_inline(_html.escape(m_h.group(2), quote=False))}</h{level}>")
        elif m_ul or m_ol:
            flush_para()
            kind = "ul" if m_ul else "ol"
            if lst != kind:
                close_list(); html.append(f"<{kind}>"); lst = kind
            item = (m_ul or m_ol).group(1)
            html.append(f"<li>{_inline(_html.escape(item, quote=False))}</li>")
        elif lst and line.startswith(("  ", "\t")) and html and html[-1].startswith("<li>"):
            html[-1] = html[-1][:-5] + " " + _inline(_html.escape(st, quote=False)) + "</li>"
        else:
            close_list()
            para.append(st)
        i += 1
    flush_para(); close_list()
    return "\n".join(html)


def _outside_fences(lines: Sequence[str]) -> list[str]:
    """The lines a heading may be on: not inside a fenced code block (a `# comment` there is code, not a heading)."""
    out, fenced = [], False
    for line in lines:
        if line.strip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            out.append(line)
    return out


def _outline(lines: Sequence[str]) -> Callable[[int], int]:
    """Map markdown heading depths to HTML levels under a section's h2: the distinct depths used rank h3, h4, h5
    (so a text whose only headings are `##` gets h3, not h4), and a heading never goes more than one level below
    the one before it (a `###` straight after the h2 is an h3), so the page outline skips no level."""
    depths = sorted({len(m.group(1)) for m in (re.match(r"(#{1,3})\s+", l.strip()) for l in _outside_fences(lines))
                     if m})
    rank = {d: 3 + i for i, d in enumerate(depths)}
    previous = [2]

    def level(depth: int) -> int:
        previous[0] = min(rank[depth], previous[0] + 1)
        return previous[0]

    return level


def _th_scope(table: str) -> str:
    """pandas' `to_html` writes bare `<th>`: header cells in `<thead>` label columns, those in `<tbody>` rows."""
    head, sep, body = table.partition("</thead>")
    if not sep:
        return table.replace("<th>", '<th scope="row">').replace("<th ", '<th scope="row" ')
    head = head.replace("<th>", '<th scope="col">').replace("<th ", '<th scope="col" ')
    return head + sep + body.replace("<th>", '<th scope="row">').replace("<th ", '<th scope="row" ')


def _slug(s: str, n: int) -> str:
    base = re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-")[:40]
    return f"s{n}-{base}" if base else f"s{n}"


def _png_width(path: Path) -> int | None:
    try:
        with open(path, "rb") as f:
            head = f.read(24)
    except OSError:
        return None
    if head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR":
        return int.from_bytes(head[16:20], "big")
    return None


def _place_image(src: Path, folder: Path, images_dir: Path, n_section: int, used: set[str]) -> str:
    src = src.resolve()
    if not src.is_file():
        raise FileNotFoundError(f"report image {src} does not exist.")
    try:
        rel = src.relative_to(folder.resolve())
        return rel.as_posix()
    except ValueError:
        pass
    images_dir.mkdir(parents=True, exist_ok=True)
    name = f"s{n_section:02d}_{src.name}"
    stem, suffix = Path(name).stem, Path(name).suffix
    k = 1
    while name in used:
        name = f"{stem}_{k}{suffix}"; k += 1
    used.add(name)
    shutil.copyfile(src, images_dir / name)
    return f"{images_dir.name}/{name}"


_BUNDLE_RE = re.compile(r"<script\s+" + re.escape(circuits.BUNDLE_MARKER) + r">.*?</script>", re.S)


def _html_item(item: Any) -> tuple[str, bool]:
    """(HTML to embed, whether it needs the circuitsvis bundle in the page head)."""
    if circuits.parse_view(item) is not None:
        frag = circuits.to_html(item, full_document=False, include_bundle=False)
        return f'<div class="view">{frag}</div>', "CircuitsVis.render(" in frag
    if isinstance(item, circuits.OfflineView):
        return _html_item(item.view)
    if not isinstance(item, str):
        if hasattr(item, "_repr_html_"):
            item = item._repr_html_()
        else:
            raise ArgumentTypeError(f"Section.html entries must be HTML strings or circuitsvis views, got {type(item).__name__}.")
    stripped, n = _BUNDLE_RE.subn("", item)
    if re.match(r"\s*(<!doctype|<html)", stripped, re.I):
        if n:  # a full page from circuits.to_html: keep it whole, in an iframe
            stripped = item
        return (f'<iframe class="view" srcdoc="{_html.escape(stripped, quote=True)}" loading="lazy" '
                f'onload="{_html.escape(_IFRAME_FIT, quote=True)}"></iframe>', False)
    return f'<div class="view">{stripped}</div>', bool(n) or "CircuitsVis.render(" in stripped


def _table_html(df: Any, caption: str = "", classes: str = "data") -> str:
    try:
        body = df.to_html(classes=classes, border=0, max_rows=300, max_cols=None, na_rep="–",
                          float_format=lambda x: f"{x + 0.0:.4g}")  # + 0.0: -0.0 prints as 0
    except TypeError:
        body = df.to_html(classes=classes, border=0)
    body = _th_scope(body)
    cap = f'<div class="tcap">{_inline(_html.escape(caption, quote=False))}</div>' if caption else ""
    return f'<div class="tablewrap">{cap}{body}</div>'


def _folders_text(folder: Path, placed: list[str]) -> str:
    """The folders the images really live in (relative to the report), for the footer."""
    dirs = sorted({str(Path(r).parent) for r in placed})
    if not dirs:
        return "no image files (this page has none)"
    return ", ".join(f"<code>{_html.escape(d if d != '.' else './')}/</code>".replace("//", "/") for d in dirs)


def write_report(folder: str | Path, title: str, sections: Sequence[Section], meta: Mapping[str, Any] | None = None,
                 subtitle: str = "", image_dpi: float | None = 130) -> Path:
    """Write `folder/index.html` (and `folder/images/`) and return the index path. The page works offline:
    it has no remote scripts, styles or images. PNGs are displayed at `96 / image_dpi` of their pixel
    width (the figures here are saved at 130 dpi), capped at the page width; `image_dpi=None` shows them
    at natural size."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if not isinstance(title, str):
        raise ArgumentTypeError(f"title={validate.describe(title)} is not a str.", argument="title", value=title,
                                allowed="a str")
    sections = validate.instances(sections, Section, name="sections")
    if image_dpi is not None:
        image_dpi = validate.number(image_dpi, name="image_dpi", min=0.0, min_open=True)
    images_dir = folder / "images"
    used: set[str] = set()
    placed: list[str] = []
    need_bundle = False
    toc, body = [], []
    for n, sec in enumerate(sections, 1):
        sid = _slug(sec.title, n)
        toc.append(f'<li><a href="#{sid}">{_html.escape(sec.title)}</a></li>')
        parts = [f'<section id="{sid}"><h2>{n}. {_html.escape(sec.title)}</h2>']
        if sec.text:
            parts.append(markdown_lite(sec.text))
        if sec.absent:
            parts.append('<p class="absent"><b>Not in this section:</b> '
                         + "; ".join(_inline(_html.escape(a, quote=False)) for a in sec.absent) + ".</p>")
        for img in sec.images:
            path, cap = (img if isinstance(img, (tuple, list)) else (img, ""))
            rel = _place_image(Path(path), folder, images_dir, n, used)
            placed.append(rel)
            alt = _html.escape(cap or f"{sec.title}: figure {Path(path).stem.replace('_', ' ')}")
            capt = f"<figcaption>{_inline(_html.escape(cap, quote=False))}</figcaption>" if cap else ""
            # show PNGs at 96/dpi of their pixel width, so text in every figure appears at the same size
            px = _png_width(folder / rel)
            width = f' style="width:{round(px * 96 / image_dpi)}px"' if px and image_dpi else ""
            parts.append(f'<figure><a href="{_html.escape(rel)}"><img src="{_html.escape(rel)}" alt="{alt}"'
                         f'{width} loading="lazy"></a>{capt}</figure>')
        for item in sec.html:
            frag, needs = _html_item(item)
            need_bundle |= needs
            parts.append(frag)
        if sec.table is not None:
            parts.append(_table_html(sec.table, sec.table_caption))
        if sec.claims is not None:
            parts.append(_table_html(sec.claims.set_index(sec.claims.columns[0]), "comparisons: Δ = mean over items, 95% percentile-bootstrap "
                                                 "interval resampling items (seeded); a claim needs the interval "
                                                 "off 0, otherwise it is a tie", classes="data claims"))
        if sec.finding:
            parts.append(f'<p class="finding"><b>Finding.</b> {_inline(_html.escape(sec.finding, quote=False))}</p>')
        parts.append("</section>")
        body.append("\n".join(parts))
    meta_rows = "".join(f'<tr><th scope="row" class="k">{_html.escape(str(k))}</th><td class="v">{_html.escape(str(v))}</td></tr>'
                        for k, v in (meta or {}).items())
    try:
        from mdm_lens import __version__ as version
    except ImportError:  # pragma: no cover
        version = "?"
    head_js = circuits.bundle_script() if need_bundle else ""
    page = ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
            f"<title>{_html.escape(title)}</title>\n<style>{_CSS}</style>\n{head_js}\n</head>\n<body><main>\n"
            f"<h1>{_html.escape(title)}</h1>\n"
            + (f'<div class="sub">{_inline(_html.escape(subtitle, quote=False))}</div>\n' if subtitle else "")
            + (f'<table class="meta">{meta_rows}</table>\n' if meta_rows else "")
            + (f'<nav class="toc"><b>Contents</b><ol>{"".join(toc)}</ol></nav>\n' if toc else "")
            + "\n".join(body)
            + f'\n<footer>Written by mdm_lens {version}. Self-contained: opens offline; images in '
              f'{_folders_text(folder, placed)}.</footer>\n</main></body></html>\n')
    index = folder / "index.html"
    
    index.write_text(page, encoding="utf-8")
    return index
