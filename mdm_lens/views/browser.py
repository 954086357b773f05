"""Headless Chromium for checking pages as a person's browser renders them: the DOM after the scripts ran, the
console errors, the network requests the page attempted, and screenshots. Used by the browser tests and by
`docs/screenshots.py`; needs Debian's `chromium` (or any Chromium / Chrome on PATH).

A copy of the page gets a first `<script>` that records `console.error`, uncaught errors and, after `load`,
the resources the page fetched (`performance.getEntriesByType("resource")`) as attributes of `<html>`, so one
`--dump-dom` run reads them all back. Networking is cut (`--host-resolver-rules`: every host fails to resolve),
so a page that needs the network shows it as a request entry or an error, never as a silent success.
"""

from __future__ import annotations

import html.parser
import json
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from mdm_lens.errors import InputError

__all__ = ["find_chromium", "load", "screenshot", "Page", "Element"]

_BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")
_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
          "--disable-background-networking", "--disable-component-update", "--disable-sync",
          "--host-resolver-rules=MAP * ~NOTFOUND", "--virtual-time-budget=5000"]

_PRELUDE = """<script>(function(){var d=document.documentElement,n=0,e=[];
function put(m){e.push(String(m));d.setAttribute("data-console-errors",JSON.stringify(e));}
var ce=console.error;console.error=function(){put(Array.prototype.join.call(arguments," "));return ce.apply(console,arguments);};
window.addEventListener("error",function(ev){put("uncaught: "+ev.message);});
window.addEventListener("load",function(){setTimeout(function(){var r=performance.getEntriesByType("resource").map(function(x){return x.name;});
d.setAttribute("data-resources",JSON.stringify(r));d.setAttribute("data-loaded","1");},0);});
d.setAttribute("data-console-errors","[]");})();</script>"""


def find_chromium() -> str | None:
    """The path of a Chromium-family browser on PATH, or None."""
    for name in _BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


def _browser() -> str:
    path = find_chromium()
    if path is None:
        raise InputError("no Chromium found on PATH (Debian: apt-get install chromium).", argument="browser",
                         value=None, allowed="one of " + ", ".join(_BROWSERS))
    return path


def _instrumented(path: Path) -> Path:
    """A copy of `path` beside it (relative links keep working) with the prelude as the first script."""
    text = path.read_text(encoding="utf-8")
    m = re.search(r"<head[^>]*>", text, flags=re.I)
    text = text[: m.end()] + _PRELUDE + text[m.end():] if m else _PRELUDE + text
    out = path.parent / f".{path.stem}.instrumented{path.suffix}"
    out.write_text(text, encoding="utf-8")
    return out


@dataclass
class Element:
    tag: str
    attrs: dict[str, str]
    text: str = ""
    children: list["Element"] = field(default_factory=list)

    def find_all(self, tag: str | None = None, **attrs: str) -> list["Element"]:
        """Descendants with this tag (any when None) whose attributes contain `attrs` (`class_` matches one class)."""
        found = []
        for c in self.children:
            ok = tag is None or c.tag == tag
            for k, v in attrs.items():
                if k == "class_":
                    ok = ok and v in c.attrs.get("class", "").split()
                else:
                    ok = ok and c.attrs.get(k.replace("_", "-")) == v
            if ok:
                found.append(c)
            found.extend(c.find_all(tag, **attrs))
        return found

    def text_content(self) -> str:
        return self.text + "".join(c.text_content() for c in self.children)


class _Tree(html.parser.HTMLParser):
    VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Element("#document", {})
        self.stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list) -> None:
        e = Element(tag, {k: (v or "") for k, v in attrs})
        self.stack[-1].children.append(e)
        if tag not in self.VOID:
            self.stack.append(e)

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self.stack) - 1, 0, -1):
            if self.stack[i].tag == tag:
                del self.stack[i:]
                return

    def handle_data(self, data: str) -> None:
        # text after a child belongs to the parent; kept in order as a text-only child
        self.stack[-1].children.append(Element("#text", {}, data))


@dataclass
class Page:
    """A rendered page: its DOM tree, console errors, attempted requests, and the raw DOM text."""

    dom: Element
    console_errors: list[str]
    resources: list[str]
    raw: str
    loaded: bool


def load(path: str | Path, fragment: str = "", timeout: float = 60.0) -> Page:
    """Render `path` (a local HTML file; `fragment` is the URL's `#...` part) in headless Chromium."""
    path = Path(path).resolve()
    if not path.is_file():
        raise InputError(f"path={str(path)!r} is not a file.", argument="path", value=str(path),
                         allowed="an existing HTML file")
    with tempfile.TemporaryDirectory(prefix="mdm-browser-") as profile:
        page = _instrumented(path)
        try:
            url = page.as_uri() + (f"#{fragment.lstrip('#')}" if fragment else "")
            proc = subprocess.run([_browser(), *_FLAGS, f"--user-data-dir={profile}", "--dump-dom", url],
                                  capture_output=True, text=True, timeout=timeout)
        finally:
            page.unlink(missing_ok=True)
    tree = _Tree()
    tree.feed(proc.stdout)
    html_el = next((c for c in tree.root.children if c.tag == "html"), tree.root)
    errors = json.loads(html_el.attrs.get("data-console-errors", "[]") or "[]")
    uncaught = [ln for ln in proc.stderr.splitlines() if "CONSOLE" in ln and "Uncaught" in ln]
    return Page(tree.root, errors + uncaught, json.loads(html_el.attrs.get("data-resources", "[]") or "[]"),
                proc.stdout, html_el.attrs.get("data-loaded") == "1")


def screenshot(path: str | Path, png: str | Path, fragment: str = "", size: tuple[int, int] = (1200, 900),
               timeout: float = 60.0) -> Path:
    """A PNG of `path` rendered at `size` (width, height)."""
    path, png = Path(path).resolve(), Path(png).resolve()
    with tempfile.TemporaryDirectory(prefix="mdm-browser-") as profile:
        url = path.as_uri() + (f"#{fragment.lstrip('#')}" if fragment else "")
        subprocess.run([_browser(), *_FLAGS, f"--user-data-dir={profile}", f"--window-size={size[0]},{size[1]}",
                        f"--screenshot={png}", url], capture_output=True, text=True, timeout=timeout)
    if not png.is_file():
        raise InputError(f"Chromium wrote no screenshot for {path}.", argument="path", value=str(path),
                         allowed="a page Chromium can render")
    return png
