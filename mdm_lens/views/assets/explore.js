// mdm_lens step explorer: dependency-free, reads its data from the JSON <script> beside it.
// Every value shown is also written to data-* attributes, so a browser test can read the DOM back.
function mdxExplore(uid) {
  "use strict";
  var t0 = performance.now();
  var root = document.getElementById(uid);
  var errors = document.createElement("pre");
  errors.className = "mdx-errors";
  function fail(msg) { errors.textContent += msg + "\n"; root.dataset.errors = String(errors.textContent.split("\n").length - 1); }
  window.addEventListener("error", function (e) { fail(String(e.message)); });
  var D;
  try { D = JSON.parse(document.getElementById(uid + "-data").textContent); } catch (e) { root.appendChild(errors); fail("data: " + e); return; }
  root.dataset.errors = "0";
  function el(tag, cls, text) { var e = document.createElement(tag); if (cls) e.className = cls; if (text !== undefined) e.textContent = text; return e; }
  function colour(step, n) {  // early commits dark blue, late commits yellow (a viridis-like ramp)
    var t = n > 1 ? step / (n - 1) : 0, h = 250 - 190 * t, l = 30 + 45 * t;
    return "hsl(" + h.toFixed(0) + ",70%," + l.toFixed(0) + "%)";
  }
  function mapStep(n0, n, k) { return n0 === n ? k : (n0 === 1 ? 0 : Math.round(k * (n - 1) / (n0 - 1))); }
  function nearestShown(steps, s) { var best = 0; for (var i = 0; i < steps.length; i++) if (Math.abs(steps[i] - s) < Math.abs(steps[best] - s)) best = i; return best; }
  var run0 = D.runs[0];
  var controls = el("div", "mdx-controls");
  var title = el("div", "mdx-head", D.title);
  var slider = el("input"); slider.type = "range"; slider.min = 0; slider.max = run0.steps.length - 1; slider.value = 0;
  slider.className = "mdx-step"; slider.setAttribute("aria-label", "denoising step");
  var stepLabel = el("output", "mdx-step-label");
  var play = el("button", "mdx-play", "play"); play.type = "button";
  var layerSel = el("select", "mdx-layer"); layerSel.setAttribute("aria-label", "layer");
  var headSel = el("select", "mdx-head-select"); headSel.setAttribute("aria-label", "head");
  var rec = null; D.runs.forEach(function (r) { if (!rec && r.received) rec = r.received; });
  if (rec) {
    rec.layers.forEach(function (l, i) { var o = el("option", null, "layer " + l); o.value = String(i); layerSel.appendChild(o); });
    rec.heads.forEach(function (h, i) { var o = el("option", null, h === "mean" ? "head mean" : "head " + h); o.value = String(i); headSel.appendChild(o); });
    headSel.value = String(rec.heads.length - 1);
  }
  var lensBox = el("input"); lensBox.type = "checkbox"; lensBox.className = "mdx-lens-toggle";
  var lensLabel = el("label", null, " lens top-1"); lensLabel.prepend(lensBox);
  [slider, stepLabel, play].forEach(function (c) { controls.appendChild(c); });
  if (rec) { controls.appendChild(layerSel); controls.appendChild(headSel); }
  if (D.runs.some(function (r) { return r.lens; })) controls.appendChild(lensLabel);
  if (root.dataset.title !== "0") root.appendChild(title);
  root.appendChild(controls);
  var legend = el("div", "mdx-legend", "colour: the step that committed a token (dark = early, light = late); black outline: committed at this step; " +
    "[MASK]: not yet committed; red: an anchor of this step (zscore rule); bar: attention the key receives in the selected layer and head (forward of this step).");
  root.appendChild(legend);
  var notes = el("ul", "mdx-notes");
  D.notes.concat.apply(D.notes, D.runs.map(function (r) { return r.notes.map(function (n) { return r.label + ": " + n; }); }))
    .forEach(function (n) { notes.appendChild(el("li", null, n)); });
  root.appendChild(notes);
  var panels = D.runs.map(function (r, i) {
    var p = el("section", "mdx-run"); p.dataset.run = String(i);
    var head = el("div", "mdx-head", r.label);
    var meta = el("span", "mdx-meta"); head.appendChild(meta);
    var strip = el("div", "mdx-tokens");
    var toks = r.tokens.map(function (t, pos) {
      var s = el("span", "mdx-tok"); s.dataset.pos = String(pos); s.dataset.commitStep = String(r.commit_step[pos]);
      var text = el("span", "mdx-text", t); var bar = el("span", "mdx-bar");
      var lens = el("span", "mdx-lens"); var age = el("span", "mdx-age");
      s.appendChild(text); s.appendChild(bar); s.appendChild(lens); s.appendChild(age); strip.appendChild(s);
      return {span: s, text: text, bar: bar, lens: lens, age: age, token: t};
    });
    var canvas = el("canvas", "mdx-pattern"); var readout = el("div", "mdx-readout");
    p.appendChild(head); p.appendChild(strip); p.appendChild(canvas); p.appendChild(readout);
    root.appendChild(p);
    return {run: r, el: p, meta: meta, toks: toks, canvas: canvas, readout: readout};
  });
  root.appendChild(errors);
  function drawPattern(P, mat) {
    var c = P.canvas, n = mat.length, m = mat[0].length, cell = Math.max(2, Math.min(8, Math.floor(480 / Math.max(n, m))));
    c.width = m * cell; c.height = n * cell; c.style.display = "block";
    var g = c.getContext("2d"), mx = 0;
    mat.forEach(function (row) { row.forEach(function (v) { if (v !== null && v > mx) mx = v; }); });
    mat.forEach(function (row, q) { row.forEach(function (v, k) {
      var a = v === null ? 0 : v / (mx || 1); g.fillStyle = "rgba(31,119,180," + a.toFixed(3) + ")"; g.fillRect(k * cell, q * cell, cell, cell);
    }); });
    c.onmousemove = function (e) {
      var r = c.getBoundingClientRect(), k = Math.floor((e.clientX - r.left) / cell), q = Math.floor((e.clientY - r.top) / cell);
      if (q >= 0 && q < n && k >= 0 && k < m) P.readout.textContent = "query " + q + " (" + P.toks[q].token + ") → key " + k + " (" + P.toks[k].token + "): " + (mat[q][k] === null ? "–" : mat[q][k].toFixed(4));
    };
  }
  function render() {
    var k0 = run0.steps[+slider.value], li = +layerSel.value || 0, hi = +headSel.value || 0;
    stepLabel.textContent = "step " + k0 + " / " + (run0.n_steps - 1);
    root.dataset.step = String(k0);
    panels.forEach(function (P) {
      var r = P.run, want = mapStep(run0.n_steps, r.n_steps, k0), si = nearestShown(r.steps, want), step = r.steps[si];
      P.el.dataset.step = String(step);
      var block = r.block_of_step[step];
      P.meta.textContent = "sampler " + r.sampler + " · step " + step + " / " + (r.n_steps - 1) +
        (r.block_length ? " · block " + block + " (length " + r.block_length + ")" : "") + (step !== want ? " (nearest shown to " + want + ")" : "");
      var vals = r.received && r.received.values[si] ? r.received.values[si][Math.min(li, r.received.values[si].length - 1)] : null;
      var row = vals ? vals[Math.min(hi, vals.length - 1)] : null;
      var anchors = r.anchors && r.anchors[si] ? r.anchors[si][Math.min(li, r.anchors[si].length - 1)][Math.min(hi, vals ? vals.length - 1 : 0)] : [];
      var mx = 0; if (row) row.forEach(function (v) { if (v !== null && v > mx) mx = v; });
      P.toks.forEach(function (T, pos) {
        var c = r.commit_step[pos], state = r.pad[pos] ? "pad" : c < 0 ? "prompt" : c < step ? "committed" : c === step ? "new" : "masked";
        T.span.dataset.state = state;
        T.text.textContent = state === "masked" ? "[MASK]" : T.token;
        T.text.style.background = (state === "committed" || state === "new") ? colour(c, r.n_steps) : "";
        T.text.style.color = (state === "committed" || state === "new") && c / Math.max(1, r.n_steps - 1) < 0.6 ? "#fff" : "";
        var v = row && pos < row.length ? row[pos] : null;
        if (v === null || v === undefined) { delete T.span.dataset.received; T.bar.style.height = "0px"; }
        else { T.span.dataset.received = String(v); T.bar.style.height = (mx > 0 ? 2 + 28 * v / mx : 0).toFixed(1) + "px"; }
        T.span.title = "position " + pos + (c >= 0 ? " · committed at step " + c : " · prompt") + (v !== null && v !== undefined ?
          (r.received.kind === "cumulative" ? " · cumulative received " : " · received ") + v.toFixed(4) : "");
        T.span.dataset.anchor = anchors && anchors.indexOf(pos) >= 0 ? "1" : "0";
        var span = r.block_span ? r.block_span[si] : null;  // the decoded block's positions (from the run itself)
        T.span.classList.toggle("mdx-block", !!span && pos >= span[0] && pos < span[1]);
        var age = r.kv_age && r.kv_age[si] ? r.kv_age[si][pos] : null;
        T.age.textContent = age === null || age === undefined ? "" : "age " + age;
        var lens = lensBox.checked && r.lens && r.lens[si] && r.lens[si][li] ? r.lens[si][li][pos] : null;
        T.lens.textContent = lens === null || lens === undefined ? "" : lens;
      });
      var pat = r.patterns && r.patterns[String(step)] ? r.patterns[String(step)][String(r.received ? r.received.layers[li] : li)] : null;
      if (pat) { drawPattern(P, pat[Math.min(hi, pat.length - 1)]); P.el.dataset.pattern = "1"; }
      else { P.canvas.style.display = "none"; P.el.dataset.pattern = "0"; P.readout.textContent = r.patterns ? "no pattern cached at step " + step + " (cached: " + Object.keys(r.patterns).join(", ") + ")" : ""; }
    });
  }
  var timer = null;
  play.onclick = function () {
    if (timer) { clearInterval(timer); timer = null; play.textContent = "play"; return; }
    play.textContent = "pause";
    timer = setInterval(function () {
      if (+slider.value >= +slider.max) { clearInterval(timer); timer = null; play.textContent = "play"; return; }
      slider.value = String(+slider.value + 1); slider.dispatchEvent(new Event("input"));
    }, 400);
  };
  [slider, layerSel, headSel, lensBox].forEach(function (c) { c.addEventListener("input", render); c.addEventListener("change", render); });
  // #step=K&layer=L&head=H (K: a step of the first run; L: a recorded layer; H: a head or "mean") sets the controls
  // through the same input events a person's clicks send, so a headless browser can check any state.
  var want = {}; (location.hash || "").slice(1).split("&").forEach(function (kv) { var p = kv.split("="); if (p[0]) want[p[0]] = decodeURIComponent(p[1] || ""); });
  if (want.step !== undefined) { slider.value = String(nearestShown(run0.steps, +want.step)); }
  if (rec && want.layer !== undefined) { var li = rec.layers.indexOf(+want.layer); if (li >= 0) layerSel.value = String(li); }
  if (rec && want.head !== undefined) { var hi = rec.heads.indexOf(want.head); if (hi >= 0) headSel.value = String(hi); }
  if (want.lens === "1") lensBox.checked = true;
  render();
  slider.dispatchEvent(new Event("input"));
  root.dataset.resources = String(performance.getEntriesByType ? performance.getEntriesByType("resource").length : 0);
  root.dataset.renderMs = (performance.now() - t0).toFixed(1);
  root.dataset.ready = "1";
}
