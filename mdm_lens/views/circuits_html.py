"""Offline HTML for the circuitsvis views of :mod:`mdm_lens.views.circuits` (the rendering half), and the
token-label helpers both halves share.

Offline rendering: what we found in circuitsvis 1.43.3 (`circuitsvis/utils/render.py`)
--------------------------------------------------------------------------------------
* Each view is a `RenderedHTML` holding two sources. `cdn_src` imports
  `https://unpkg.com/circuitsvis@<version>/dist/cdn/esm.js` (network). `local_src` inlines the
  1.3 MB React bundle that ships inside the wheel (`circuitsvis/dist/cdn/iife.js`) in a
  `<script type="module">`, so it needs no network.
* `str(view)` and `view.show_code()` return the **CDN** source. They are blank offline.
* `view._repr_html_()` (Jupyter) first calls `urllib.request.urlopen("http://google.com", timeout=1)`.
  That is a network probe on every display. If the probe succeeds it returns the CDN source, otherwise the
  local one. So a notebook renders in both cases, but an HTML file saved from it may depend on unpkg.
* The bundle itself fetches nothing at render time. Its only URLs are in comments and error
  strings. We checked this by rendering in headless Chromium with background networking off.

What `to_html` does:
* Default path ("circuitsvis", used whenever `iife.js` is present): it inlines that bundle once, as a
  *classic* `<script>`, which defines the global `CircuitsVis`. Each view is then a `<div>` plus a small
  `CircuitsVis.render(id, CircuitsVis.<Element>, props)` call. The props are recovered from the view's
  own source. A report with many views therefore carries the bundle only once (`report.write_report`
  deduplicates it).
* Fallback path ("fallback", used when the bundle is missing, or on request): a small dependency-free
  renderer. Attention patterns get a canvas heatmap with a head selector (plus the head mean) and a
  hover read-out. Tokens are coloured by the column mean. `ColoredTokens` become coloured `<span>`s.
  Any other element gets a notice.
Neither path references a remote script.
"""

from __future__ import annotations

import html as _html
import json
import re
import uuid
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal, Sequence

import numpy as np

from mdm_lens import validate
from mdm_lens.errors import InputError

__all__ = ["to_html", "offline", "OfflineView", "bundle_available", "bundle_script", "parse_view", "BUNDLE_MARKER"]

BUNDLE_MARKER = 'data-mdm-lens="circuitsvis-bundle"'
Renderer = Literal["auto", "circuitsvis", "fallback"]


ZWSP = "\u200b"
EMPTY_LABEL = "\u2205"   # ∅: a token whose text is empty would otherwise be an invisible box


def _visible(label: str) -> str:
    """A label that reads the same wherever circuitsvis puts it.

    circuitsvis sets a token's text as *HTML* in its token strips (`dangerouslySetInnerHTML`), so
    `<bos>`, `<eos>` or `<|endoftext|>` parse as unknown tags and show blank, and `&lt;` shows as `<`;
    its heatmap axes and tooltips print the same string as *plain text*, so HTML-escaping would show
    `&lt;bos&gt;` there.  A zero-width space after each `<` and `&` fixes both: `<` followed by a
    non-letter and `&` followed by a non-name character are literal text in HTML, and the zero-width
    space draws nothing in either place.  Empty labels become `∅`."""
    if not label:
        return EMPTY_LABEL
    return label.replace("&", "&" + ZWSP).replace("<", "<" + ZWSP)


def _plain(label: str) -> str:
    """Undo `_visible` (for the fallback renderer, which escapes text itself)."""
    return str(label).replace("<" + ZWSP, "<").replace("&" + ZWSP, "&")


def _display(str_tokens: Sequence[Any]) -> list[str]:
    """Labels as circuitsvis prints them, run together. A word-level vocabulary (no label carries a space)
    would read as one long word, so such labels get a leading space; BPE labels keep their own. Special
    tokens (`<bos>`, `<eos>`, ...) stay visible (see `_visible`)."""
    tokens = [str(t) for t in str_tokens]
    if tokens and not any(any(c.isspace() for c in t) for t in tokens):
        tokens = [tokens[0]] + [" " + t for t in tokens[1:]]
    return [_visible(t) for t in tokens]


def _bundle_path() -> Path | None:
    try:
        import circuitsvis
    except ImportError:
        return None
    p = Path(circuitsvis.__file__).parent / "dist" / "cdn" / "iife.js"
    return p if p.is_file() else None


def bundle_available() -> bool:
    """Whether circuitsvis ships its browser bundle (`dist/cdn/iife.js`), so the default offline path works."""
    return _bundle_path() is not None


@lru_cache(maxsize=1)
def _bundle_js() -> str:
    p = _bundle_path()
    if p is None:
        return ""
    js = p.read_text(encoding="utf-8")
    js = re.sub(r"//# sourceMappingURL=\S+\s*$", "", js)  # the .map is not shipped alongside
    return js.replace("</script", "<\\/script").replace("<!--", "<\\!--")


def bundle_script() -> str:
    """A classic `<script>` that defines the global `CircuitsVis` from the local bundle. It is "" if there
    is no bundle."""
    js = _bundle_js()
    return f"<script {BUNDLE_MARKER}>{js}</script>" if js else ""


_CDN_RE = re.compile(r'import\s*\{\s*render,\s*(\w+)\s*\}\s*from\s*"[^"]*";\s*render\(\s*"[^"]*",\s*\w+,\s*(.*)\)\s*'
                     r'</script>\s*$', re.S)
_LOCAL_RE = re.compile(r'CircuitsVis\.render\(\s*"[^"]*",\s*CircuitsVis\.(\w+),\s*(.*)\)\s*</script>\s*$', re.S)


def parse_view(view: Any) -> tuple[str, dict] | None:
    """`(element name, props)` of a circuitsvis `RenderedHTML`, or None when the view is not one."""
    for attr, rx in (("cdn_src", _CDN_RE), ("local_src", _LOCAL_RE)):
        src = getattr(view, attr, None)
        if not isinstance(src, str):
            continue
        tail = src[-200_000:] if attr == "local_src" else src  # the props follow the bundle
        m = rx.search(tail)
        if m:
            try:
                return m.group(1), json.loads(m.group(2))
            except json.JSONDecodeError:
                continue
    return None


def _js_json(obj: Any) -> str:
    s = json.dumps(obj, allow_nan=True, separators=(",", ":"))
    return s.replace("</", "<\\/").replace("<!--", "<\\!--")


def _cv_fragment(element: str, props: dict, include_bundle: bool) -> str:
    uid = "mdmcv-" + uuid.uuid4().hex[:12]
    call = (f'<div id="{uid}" class="mdm-cv" style="margin: 12px 0;"></div>\n'
            f'<script>CircuitsVis.render("{uid}", CircuitsVis.{element}, {_js_json(props)});</script>')
    return (bundle_script() + "\n" + call) if include_bundle else call


_FALLBACK_CSS = """
.mdmfb{font:13px/1.4 system-ui,-apple-system,"Segoe UI",sans-serif;color:#222;margin:12px 0}
.mdmfb .ctl{margin-bottom:6px}.mdmfb .ctl select{font:inherit;margin-left:4px}
.mdmfb .info{margin-left:12px;color:#555;font-family:ui-monospace,Menlo,Consolas,monospace}
.mdmfb canvas{display:block;border:1px solid #ddd}
.mdmfb .toks{margin-top:8px;line-height:1.9}
.mdmfb .tok{display:inline-block;padding:0 3px;margin:1px;border-radius:3px;border:1px solid #e2e2e2;
 font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px;white-space:pre}
.mdmfb .note{color:#777;font-size:12px;margin-top:4px}
"""

_FALLBACK_ATTN_JS = r"""
(function(){
var D=__DATA__, root=document.getElementById("__ID__");
var T=D.tokens.length, H=D.attention.length, names=D.names;
var sel=root.querySelector("select.head"), rel=root.querySelector("select.scale"), info=root.querySelector(".info"), cv=root.querySelector("canvas"),
    toks=root.querySelector(".toks");
for(var h=0;h<H;h++){var o=document.createElement("option");o.value=h;o.textContent=names[h];sel.appendChild(o);}
var om=document.createElement("option");om.value=-1;om.textContent="mean of heads";sel.appendChild(om);
function mat(h){if(h>=0)return D.attention[h];var m=[];for(var i=0;i<T;i++){m.push([]);
  for(var j=0;j<T;j++){var s=0;for(var k=0;k<H;k++)s+=D.attention[k][i][j];m[i].push(s/H);}}return m;}
function short(s){s=String(s).replace(/\n/g,"\\n");return s.length>10?s.slice(0,9)+"\u2026":s;}
var cell=Math.max(3,Math.min(18,Math.floor(640/Math.max(T,1)))), lab=cell>=7?96:8, M=null, vmax=1;
cv.width=lab+T*cell+2; cv.height=lab+T*cell+2;
function color(v){var top=rel.value==="rel"?vmax:1;var t=Math.sqrt(Math.max(0,Math.min(1,v/top)));   // sqrt: weak links stay visible
  var r=Math.round(255+(0-255)*t),g=Math.round(255+(90-255)*t),b=Math.round(255+(160-255)*t);
  return "rgb("+r+","+g+","+b+")";}
function draw(){var h=parseInt(sel.value,10);M=mat(h);vmax=1e-12;
  for(var i=0;i<T;i++)for(var j=0;j<T;j++)if(M[i][j]>vmax)vmax=M[i][j];
  var c=cv.getContext("2d");c.clearRect(0,0,cv.width,cv.height);c.fillStyle="#fff";c.fillRect(0,0,cv.width,cv.height);
  for(var i=0;i<T;i++)for(var j=0;j<T;j++){
    if(D.causal&&j>i){c.fillStyle="#eee";}else{c.fillStyle=color(M[i][j]);}
    c.fillRect(lab+j*cell,lab+i*cell,cell,cell);}
  if(cell>=7){c.fillStyle="#333";c.font=Math.min(11,cell)+"px monospace";
    for(var i=0;i<T;i++){c.textAlign="right";c.textBaseline="middle";c.fillText(short(D.tokens[i]),lab-3,lab+i*cell+cell/2);}
    for(var j=0;j<T;j++){c.save();c.translate(lab+j*cell+cell/2,lab-3);c.rotate(-Math.PI/2);c.textAlign="left";
      c.textBaseline="middle";c.fillText(short(D.tokens[j]),0,0);c.restore();}}
  toks.innerHTML="";var col=[],cmax=1e-12;
  for(var j=0;j<T;j++){var s=0,n=0;for(var i=0;i<T;i++){if(D.causal&&j>i)continue;s+=M[i][j];n++;}
    col.push(s/T);if(s/T>cmax)cmax=s/T;}
  for(var j=0;j<T;j++){var e=document.createElement("span");e.className="tok";e.textContent=D.tokens[j];
    e.title="key "+j+": received attention "+col[j].toFixed(4);e.style.background=color(col[j]);
    if(Math.sqrt(col[j]/(rel.value==="rel"?vmax:1))>0.6)e.style.color="#fff";toks.appendChild(e);}
  info.textContent="max "+vmax.toFixed(3)+" \u00b7 hover a cell";}
rel.addEventListener("change",draw);
cv.addEventListener("mousemove",function(ev){var r=cv.getBoundingClientRect();
  var j=Math.floor((ev.clientX-r.left-lab)/cell), i=Math.floor((ev.clientY-r.top-lab)/cell);
  if(i>=0&&j>=0&&i<T&&j<T){info.textContent="query "+i+" "+JSON.stringify(D.tokens[i])+" \u2192 key "+j+" "+
    JSON.stringify(D.tokens[j])+": "+M[i][j].toFixed(4);}});
sel.addEventListener("change",draw); draw();
})();
"""


def _fallback_attention(props: dict, element: str) -> str:
    tokens = [_plain(t) for t in props.get("tokens", [])]
    att = props.get("attention", [])
    a = np.asarray(att, dtype=np.float64)
    if a.ndim == 2:
        a = a[None]
    if a.ndim != 3:
        return f'<div class="mdmfb" style="color:#a00">cannot draw an attention array of shape {a.shape}.</div>'
    names = props.get("attentionHeadNames") or [f"head {h}" for h in range(a.shape[0])]
    data = {"tokens": tokens, "attention": np.round(np.nan_to_num(a), 4).tolist(), "names": list(names),
            "causal": bool(props.get("maskUpperTri", False))}
    uid = "mdmfb-" + uuid.uuid4().hex[:12]
    js = _FALLBACK_ATTN_JS.replace("__DATA__", _js_json(data)).replace("__ID__", uid)
    return (f'<style>{_FALLBACK_CSS}</style><div class="mdmfb" id="{uid}">'
            f'<div class="ctl"><label>head<select class="head"></select></label> <label>colour<select class="scale">'
            f'<option value="abs">0 – 1</option><option value="rel">0 – head max</option></select></label>'
            f'<span class="info"></span></div>'
            f'<canvas></canvas><div class="toks"></div>'
            f'<div class="note">Received attention (column mean) colours the tokens; rows = queries, '
            f'columns = keys; sqrt colour scale.</div></div>'
            f'<script>{js}</script>')


def _mix(c0: tuple[int, int, int], c1: tuple[int, int, int], t: float) -> str:
    t = float(min(1.0, max(0.0, t)))
    return "#%02x%02x%02x" % tuple(round(a + (b - a) * t) for a, b in zip(c0, c1))


def _fallback_tokens(props: dict) -> str:
    tokens = [_plain(t) for t in props.get("tokens", [])]
    vals = np.nan_to_num(np.asarray(props.get("values", []), dtype=float))
    lo = props.get("minValue", float(min(0.0, vals.min())) if vals.size else 0.0)
    hi = props.get("maxValue", float(vals.max()) if vals.size else 1.0)
    spans = []
    for t, v in zip(tokens, vals):
        if v >= 0:
            bg = _mix((255, 255, 255), (0, 114, 178), v / hi if hi > 0 else 0)
        else:
            bg = _mix((255, 255, 255), (213, 94, 0), v / lo if lo < 0 else 0)
        dark = (v / hi if hi > 0 else 0) > 0.6
        spans.append(f'<span class="tok" style="background:{bg};{"color:#fff;" if dark else ""}" '
                     f'title="{v:.4g}">{_html.escape(t)}</span>')
    return (f'<style>{_FALLBACK_CSS}</style><div class="mdmfb"><div class="toks">{"".join(spans)}</div>'
            f'<div class="note">colour: {lo:g} (white) → {hi:g} (blue); hover for values</div></div>')


def _fallback_fragment(element: str, props: dict) -> str:
    if element in ("AttentionPatterns", "AttentionHeads", "AttentionPattern"):
        return _fallback_attention(props, element)
    if element == "ColoredTokens":
        return _fallback_tokens(props)
    return (f'<div class="mdmfb" style="color:#a00">The offline fallback renderer cannot draw the circuitsvis '
            f'element <code>{_html.escape(element)}</code>; install circuitsvis with its bundled '
            f'<code>dist/cdn/iife.js</code>.</div>')


def _page(body: str, title: str, head: str = "") -> str:
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\"><title>{_html.escape(title)}"
            f"</title>{head}<style>body{{font:14px/1.45 system-ui,-apple-system,'Segoe UI',sans-serif;"
            "margin:16px 24px;color:#222}h1{font-size:15px;margin:0 0 8px}</style></head>\n<body>\n"
            f"<h1>{_html.escape(title)}</h1>\n" + body + "\n</body></html>\n")  # a page has one h1


def to_html(view: Any, *, full_document: bool = True, renderer: Renderer = "auto", include_bundle: bool = True,
            title: str = "mdm_lens view") -> str:
    """Self-contained, offline HTML for a circuitsvis view (see the module docstring).

    Args:
        view: a circuitsvis `RenderedHTML` (e.g. from `attention`). An HTML string, or any object with
            `_repr_html_`, is passed through unchanged.
        full_document: return a whole `<!DOCTYPE html>` page. Otherwise return a fragment to embed.
        renderer: "auto" uses the circuitsvis bundle when it is installed and the fallback renderer
            otherwise. "circuitsvis" and "fallback" force one of them.
        include_bundle: a fragment from the circuitsvis path carries the 1.3 MB bundle unless this is
            False; the page must then include `bundle_script()` once, before the fragment.
    """
    validate.choice(renderer, ("auto", "circuitsvis", "fallback"), name="renderer")
    parsed = parse_view(view)
    if parsed is None:
        if isinstance(view, str):
            body = view
        elif hasattr(view, "_repr_html_"):
            body = view._repr_html_()
        else:
            raise InputError(f"cannot turn a {type(view).__name__} into HTML.")
        return _page(body, title) if full_document and "<html" not in body[:500].lower() else body
    element, props = parsed
    use_cv = renderer == "circuitsvis" or (renderer == "auto" and bundle_available())
    if use_cv and not bundle_available():
        raise InputError("circuitsvis's bundle (dist/cdn/iife.js) is not installed; use renderer='fallback'.")
    if not use_cv:
        frag = _fallback_fragment(element, props)
        return _page(frag, title) if full_document else frag
    if full_document:
        return _page(_cv_fragment(element, props, include_bundle=False), title,
                     head=bundle_script() if include_bundle else "")
    return _cv_fragment(element, props, include_bundle=include_bundle)


class OfflineView:
    """Wraps a view so that Jupyter shows the offline rendering: no google.com probe, no CDN.
    `str(view)` gives the same HTML."""

    def __init__(self, view: Any, renderer: Renderer = "auto"):
        self.view, self.renderer = view, renderer

    def _repr_html_(self) -> str:
        return to_html(self.view, full_document=False, renderer=self.renderer)

    def __str__(self) -> str:
        return self._repr_html_()


def offline(view: Any, renderer: Renderer = "auto") -> OfflineView:
    """`offline(attention(out, 0, 3))`: display a view in Jupyter without touching the network."""
    return OfflineView(view, renderer)
