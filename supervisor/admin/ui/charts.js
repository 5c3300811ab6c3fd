"use strict";
// Live charts of the status page: /metrics polled with the bearer token, one mark per failover from
// the event stream. Plain SVG, no library. Everything from the node is drawn with textContent.
const Charts = (() => {
  const WINDOW_MS = 15 * 60 * 1000;  // what the page keeps and draws
  const POLL_MS = 2000;
  const RATE_MS = 10000;  // rates and quantiles: over the last 10 s
  const SVG = "http://www.w3.org/2000/svg";
  const W = 480, H = 150, L = 54, R = 8, T = 10, B = 20;  // viewBox and plot margins
  const COLORS = ["#0969da", "#cf222e", "#8250df"];
  const CHARTS = [
    {id: "tokens", title: "Output tokens/s", series: [["tok", "tokens/s"]], unit: ""},
    {id: "requests", title: "Requests/s", series: [["req", "requests/s"]], unit: ""},
    {id: "ttft", title: "Time to first token (router)", series: [["ttft50", "p50"], ["ttft99", "p99"]], unit: "s"},
    {id: "itl", title: "Inter-token: engine step time", series: [["step50", "p50"], ["step99", "p99"]], unit: "s"},
    {id: "seqs", title: "Sequences on the primary", series: [["running", "running"], ["waiting", "waiting"]], unit: ""},
    {id: "kv", title: "KV cache in use on the primary", series: [["kv", "used"]], unit: "%", max: 100},
  ];
  let points = [];   // {t, tok, req, ttft50, ...}: one per poll, the last WINDOW_MS
  let samples = [];  // raw counters of the last RATE_MS, to take rates from
  let marks = [];    // {t, from, to, reason, seconds, gap, continued, failed}: one per failover
  let timer = null;
  let source = null;

  // ---------------------------------------------------------------- reading /metrics
  function parse(text) {
    const out = new Map();
    for (const line of text.split("\n")) {
      const m = /^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)/.exec(line);
      if (!m) continue;
      const labels = {};
      for (const l of (m[2] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[l[1]] = l[2];
      if (!out.has(m[1])) out.set(m[1], []);
      out.get(m[1]).push({labels, value: Number(m[3])});
    }
    return out;
  }

  const total = (fams, name) => (fams.get(name) || []).reduce((s, x) => s + x.value, 0);
  const ofEngine = (fams, name, engine) => {
    const x = (fams.get(name) || []).find((s) => s.labels.engine === engine);
    return x ? x.value : null;
  };
  const buckets = (fams, name) => (fams.get(name + "_bucket") || [])
    .map((s) => [s.labels.le === "+Inf" ? Infinity : Number(s.labels.le), s.value]).sort((a, b) => a[0] - b[0]);

  function sample(text, primary, now) {
    const f = parse(text);
    const s = {t: now, tok: total(f, "understudy_generated_tokens_total"), req: total(f, "understudy_router_requests_total"),
               ttft: buckets(f, "understudy_router_first_token_seconds"), step: buckets(f, "understudy_engine_step_seconds"),
               running: null, waiting: null, kv: null};
    if (primary) {
      s.running = ofEngine(f, "understudy_engine_running_seqs", primary);
      s.waiting = ofEngine(f, "understudy_engine_waiting_seqs", primary);
      const used = ofEngine(f, "understudy_engine_kv_blocks_used", primary);
      const all = ofEngine(f, "understudy_engine_kv_blocks_total", primary);
      s.kv = used !== null && all ? (100 * used) / all : null;
    }
    return s;
  }

  // the q-quantile of what a histogram counted between two samples (as PromQL's histogram_quantile)
  function quantile(q, now, before) {
    if (now.length !== before.length || !now.length) return null;
    const d = now.map(([le, c], i) => [le, c - before[i][1]]);
    const n = d[d.length - 1][1];
    if (!(n > 0)) return null;
    const rank = q * n;
    let lo = 0, below = 0;
    for (const [le, c] of d) {
      if (c >= rank) return le === Infinity ? lo : lo + (le - lo) * ((rank - below) / Math.max(c - below, 1e-12));
      lo = le;
      below = c;
    }
    return lo;
  }

  function addSample(s) {
    const prev = samples[samples.length - 1];
    if (prev && (s.req < prev.req || s.tok < prev.tok)) samples = [];  // counters reset: a new supervisor
    samples.push(s);
    samples = samples.filter((x) => x.t >= s.t - RATE_MS - POLL_MS);
    const p = {t: s.t, running: s.running, waiting: s.waiting, kv: s.kv,
               tok: null, req: null, ttft50: null, ttft99: null, step50: null, step99: null};
    const b = samples[0];
    if (b !== s) {
      const dt = (s.t - b.t) / 1000;
      Object.assign(p, {tok: (s.tok - b.tok) / dt, req: (s.req - b.req) / dt,
                        ttft50: quantile(0.5, s.ttft, b.ttft), ttft99: quantile(0.99, s.ttft, b.ttft),
                        step50: quantile(0.5, s.step, b.step), step99: quantile(0.99, s.step, b.step)});
    }
    points.push(p);
    prune(s.t);
  }

  function prune(now) {
    points = points.filter((p) => p.t >= now - WINDOW_MS);
    marks = marks.filter((m) => m.t >= now - WINDOW_MS);
  }

  async function poll() {
    if (!source) return;
    try {
      const [text, primary] = await source();
      addSample(sample(text, primary, Date.now()));
    } catch (_) {
      return;  // the next poll tries again; a refused token logs out (status.html)
    }
    draw();
  }

  // ---------------------------------------------------------------- failovers from the event stream
  function onEvent(ev) {
    const t = (ev.ts || Date.now() / 1000) * 1000;
    if (ev.type === "failover") {
      marks.push({t, from: ev.from || "?", to: ev.to, reason: ev.reason, seconds: ev.seconds,
                  gap: null, continued: 0, failed: 0});
    } else if (ev.type === "migration") {
      // a continuation is reported once its stream goes on: after the failover that caused it
      const m = marks.filter((x) => x.t <= t + 1000).pop();
      if (!m) return;
      if (ev.result === "continued") {
        m.continued++;
        if (typeof ev.stall_s === "number") m.gap = Math.max(m.gap || 0, ev.stall_s);
      } else {
        m.failed++;
      }
    } else {
      return;
    }
    prune(Date.now());
    draw();
  }

  // ---------------------------------------------------------------- drawing
  const secs = (x) => (x < 1 ? (x * 1000).toFixed(x < 0.01 ? 2 : 1) + " ms" : x.toFixed(2) + " s");
  function fmt(v, unit) {
    if (v === null || v === undefined || !isFinite(v)) return "–";
    if (unit === "s") return secs(v);
    if (unit === "%") return v.toFixed(0) + " %";
    return Number.isInteger(v) || v >= 100 ? v.toFixed(0) : v >= 10 ? v.toFixed(1) : v.toFixed(2);
  }

  function axis(v, unit) {  // a round number (niceMax) as short as it goes
    if (unit === "s") return v < 1 ? `${+(v * 1000).toPrecision(3)} ms` : `${+v.toPrecision(3)} s`;
    return `${+v.toPrecision(3)}${unit === "%" ? " %" : ""}`;
  }

  function el(tag, attrs, text) {
    const e = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
    if (text !== undefined) e.textContent = text;
    return e;
  }

  function describe(m) {
    const gap = m.gap === null ? "no stream was cut" : "longest stream gap " + secs(m.gap);
    const streams = m.continued || m.failed ? ` (${m.continued} streams continued, ${m.failed} not)` : "";
    return `${m.from} → ${m.to} (${m.reason}): failover ${typeof m.seconds === "number" ? secs(m.seconds) : "?"}, ${gap}${streams}`;
  }

  function niceMax(v) {
    if (!(v > 0)) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    return [1, 2, 5, 10].map((k) => k * p).find((x) => x >= v);
  }

  function drawChart(c, now) {
    const box = document.getElementById("chart-" + c.id);
    const svg = box.querySelector("svg");
    svg.replaceChildren();
    const t0 = now - Math.min(WINDOW_MS, Math.max(60000, now - (points.length ? points[0].t : now)));
    const x = (t) => L + ((t - t0) / (now - t0)) * (W - L - R);
    const values = points.flatMap((p) => c.series.map(([k]) => p[k])).filter((v) => v !== null && isFinite(v));
    const top = c.max || niceMax(Math.max(0, ...values));
    const y = (v) => H - B - (Math.min(v, top) / top) * (H - T - B);
    svg.append(el("rect", {x: L, y: T, width: W - L - R, height: H - T - B, class: "plot"}));
    svg.append(el("text", {x: L - 4, y: T + 8, class: "axis", "text-anchor": "end"}, axis(top, c.unit)));
    svg.append(el("text", {x: L - 4, y: H - B, class: "axis", "text-anchor": "end"}, "0"));
    svg.append(el("text", {x: L, y: H - 6, class: "axis"}, `−${Math.round((now - t0) / 60000)} min`));
    svg.append(el("text", {x: W - R, y: H - 6, class: "axis", "text-anchor": "end"}, "now"));
    c.series.forEach(([k], i) => {
      let d = "";
      let pen = "M";
      for (const p of points) {
        if (p[k] === null || !isFinite(p[k])) { pen = "M"; continue; }
        d += `${pen}${x(p.t).toFixed(1)},${y(p[k]).toFixed(1)}`;
        pen = "L";
      }
      if (d) svg.append(el("path", {d, class: "series", stroke: COLORS[i], "data-series": k}));
    });
    for (const m of marks) {
      if (m.t < t0) continue;
      const g = el("g", {class: "failover-mark", "data-from": m.from, "data-to": m.to, "data-seconds": m.seconds,
                         "data-gap": m.gap === null ? "" : m.gap});
      g.append(el("line", {x1: x(m.t), x2: x(m.t), y1: T, y2: H - B}), el("title", {}, describe(m)));
      svg.append(g);
    }
    const last = points.length ? points[points.length - 1] : {};
    const legend = box.querySelector(".legend");
    legend.replaceChildren();
    c.series.forEach(([k, label], i) => {
      const s = document.createElement("span");
      s.className = "key key-" + i;
      s.dataset.series = k;
      s.textContent = `${label} ${fmt(last[k], c.unit)}`;
      legend.append(s);
    });
  }

  function drawMarks() {
    const list = document.getElementById("failover-marks");
    list.replaceChildren();
    for (const m of [...marks].reverse()) {
      const li = document.createElement("li");
      li.dataset.from = m.from;
      li.dataset.to = m.to;
      const when = new Date(m.t);
      const t = document.createElement("time");
      t.textContent = when.toLocaleTimeString([], {hour12: false}) + "." + String(when.getMilliseconds()).padStart(3, "0");
      const s = document.createElement("span");
      s.textContent = describe(m);
      li.append(t, s);
      list.append(li);
    }
    if (!marks.length) {
      const li = document.createElement("li");
      li.className = "hint";
      li.textContent = "no failover in the last 15 minutes";
      list.append(li);
    }
  }

  let pending = false;
  function draw() {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => {
      pending = false;
      const now = Date.now();
      for (const c of CHARTS) drawChart(c, now);
      drawMarks();
    });
  }

  // ---------------------------------------------------------------- the page's side
  function build() {
    const grid = document.getElementById("charts");
    for (const c of CHARTS) {
      const fig = document.createElement("figure");
      fig.id = "chart-" + c.id;
      fig.className = "chart";
      const cap = document.createElement("figcaption");
      cap.textContent = c.title;
      const legend = document.createElement("div");
      legend.className = "legend";
      cap.append(legend);
      fig.append(cap, el("svg", {viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": c.title}));
      grid.append(fig);
    }
  }

  return {
    WINDOW_MS,
    /** Start polling; ``read()`` resolves to [the /metrics text, the primary's name or null]. */
    start(read) {
      source = read;
      clearInterval(timer);
      timer = setInterval(poll, POLL_MS);
      poll();
    },
    stop() { clearInterval(timer); source = null; },
    /** A new supervisor (another boot): its counters and failovers start afresh. */
    reset() { points = []; samples = []; marks = []; draw(); },
    onEvent,
    build,
  };
})();
