// A small canvas line chart for per-step series: grid, ticks, legend, min/max decimation.
//
// Written for this page instead of taken from npm: the charts are plain y-against-step
// lines, the daemon must serve everything itself (GPU boxes are often offline) and
// installing it must need no Node build; about 250 lines cover it.

import { decimateMinMax } from "./decimate.js";

const PAD = { left: 62, right: 14, top: 26, bottom: 26 };

// A growable (x, y) column pair. x is the step: a resumed run that repeats steps replaces
// the points from that step on, as the run's history now reads.
export class Series {
  constructor(key, label, color, { dots = false } = {}) {
    this.key = key;
    this.label = label;
    this.color = color;
    this.dots = dots;
    this.xs = new Float64Array(256);
    this.ys = new Float64Array(256);
    this.n = 0;
  }

  push(x, y) {
    while (this.n > 0 && this.xs[this.n - 1] >= x) this.n -= 1;
    if (this.n === this.xs.length) {
      const xs = new Float64Array(this.n * 2);
      const ys = new Float64Array(this.n * 2);
      xs.set(this.xs);
      ys.set(this.ys);
      this.xs = xs;
      this.ys = ys;
    }
    this.xs[this.n] = x;
    this.ys[this.n] = y === null || y === undefined ? NaN : y;
    this.n += 1;
  }

  finiteCount() {
    let count = 0;
    for (let i = 0; i < this.n; i++) if (Number.isFinite(this.ys[i])) count += 1;
    return count;
  }
}

// 1, 2 or 5 times a power of ten, about `count` steps over [lo, hi].
export function niceTicks(lo, hi, count) {
  if (!(hi > lo)) return [lo];
  const raw = (hi - lo) / Math.max(1, count);
  const power = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((m) => m * power).find((s) => s >= raw);
  const ticks = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) {
    ticks.push(Math.abs(t) < step * 1e-9 ? 0 : t);
  }
  return ticks;
}

// A tick label with just enough digits to tell neighbouring ticks `step` apart.
export function tickLabel(value, step) {
  if (value === 0) return "0";
  const magnitude = Math.abs(value);
  if (magnitude >= 1e5 || magnitude < 1e-3) {
    const digits = Math.max(0, Math.floor(Math.log10(magnitude)) - Math.floor(Math.log10(step)));
    return value.toExponential(Math.min(6, digits));
  }
  return value.toFixed(Math.max(0, Math.min(8, -Math.floor(Math.log10(step)))));
}

// The index of the x closest to `x` in the ascending xs[0..n), or -1 when n is 0.
export function nearest(xs, n, x) {
  if (n === 0) return -1;
  let lo = 0;
  let hi = n - 1;
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if (xs[mid] < x) lo = mid + 1;
    else hi = mid;
  }
  return lo > 0 && x - xs[lo - 1] < xs[lo] - x ? lo - 1 : lo;
}

export class LineChart {
  // `format(value)` labels the legend's latest values; `tickFormat(value, step)` the axis.
  constructor(
    canvas,
    { title, format = (v) => String(v), tickFormat = tickLabel, series, empty = "no data yet" },
  ) {
    this.canvas = canvas;
    this.empty = empty;
    this.title = title;
    this.format = format;
    this.tickFormat = tickFormat;
    this.series = new Map(series.map((s) => [s.key, s]));
    this.pending = false;
    this.drawn = 0; // points drawn last time, after decimation (tests read it)
    this.hoverX = null; // the pointer's x in CSS pixels, for the crosshair and its values
    new ResizeObserver(() => this.scheduleDraw()).observe(canvas);
    canvas.addEventListener("pointermove", (event) => {
      this.hoverX = event.offsetX;
      this.scheduleDraw();
    });
    canvas.addEventListener("pointerleave", () => {
      this.hoverX = null;
      this.scheduleDraw();
    });
  }

  // Adds a series the first time its key is seen (memory columns vary by worker version).
  ensure(key, make) {
    if (!this.series.has(key)) this.series.set(key, make());
    return this.series.get(key);
  }

  push(key, x, y) {
    this.series.get(key).push(x, y);
    this.scheduleDraw();
  }

  // Points held, all series together (null y values not counted).
  pointCount() {
    let count = 0;
    for (const s of this.series.values()) count += s.finiteCount();
    return count;
  }

  // Redraws at most once a frame, however many points arrive in between.
  scheduleDraw() {
    if (this.pending) return;
    this.pending = true;
    requestAnimationFrame(() => {
      this.pending = false;
      this.draw();
    });
  }

  range() {
    let x0 = Infinity;
    let x1 = -Infinity;
    for (const s of this.series.values()) {
      if (s.n === 0) continue;
      x0 = Math.min(x0, s.xs[0]);
      x1 = Math.max(x1, s.xs[s.n - 1]);
    }
    return [x0, x1];
  }

  draw() {
    const canvas = this.canvas;
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth;
    const height = canvas.clientHeight;
    if (width === 0 || height === 0) return;
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    const styles = getComputedStyle(canvas);
    const ink = styles.getPropertyValue("--chart-ink").trim() || "#333";
    const grid = styles.getPropertyValue("--chart-grid").trim() || "#ddd";
    const muted = styles.getPropertyValue("--muted").trim() || "#777";
    ctx.font = "12px system-ui, sans-serif";
    ctx.fillStyle = ink;
    ctx.textBaseline = "alphabetic";
    const titleWidth = ctx.measureText(this.title).width;

    const plotW = width - PAD.left - PAD.right;
    const plotH = height - PAD.top - PAD.bottom;
    const [x0, x1] = this.range();
    const kept = [];
    let lo = Infinity;
    let hi = -Infinity;
    if (Number.isFinite(x0)) {
      for (const s of this.series.values()) {
        const idx = decimateMinMax(s.xs, s.ys, s.n, x0, x1, Math.max(1, Math.floor(plotW)));
        for (const i of idx) {
          lo = Math.min(lo, s.ys[i]);
          hi = Math.max(hi, s.ys[i]);
        }
        kept.push([s, idx]);
      }
    }
    // The legend and the title share the top row: the legend drops its latest values when
    // they would run into the title, and the title is squeezed into what is left (they
    // overlapped on narrow charts with several series, the DPO rewards chart at any width).
    const legendLeft = this.drawLegend(ctx, width, PAD.left + titleWidth + 12);
    ctx.fillStyle = ink;
    ctx.textAlign = "left";
    ctx.fillText(this.title, PAD.left, 16, Math.max(24, legendLeft - 12 - PAD.left));
    if (!Number.isFinite(lo)) {
      ctx.fillStyle = muted;
      ctx.textAlign = "center";
      ctx.fillText(this.empty, PAD.left + plotW / 2, PAD.top + plotH / 2);
      this.drawn = 0;
      canvas.dataset.points = "0";
      return;
    }
    // 5% room above and below; a series that never goes negative keeps its axis at >= 0
    const pad = hi === lo ? Math.abs(hi) * 0.05 || 1 : (hi - lo) * 0.05;
    lo = lo >= 0 ? Math.max(0, lo - pad) : lo - pad;
    hi += pad;
    const sx = (x) => PAD.left + (x1 > x0 ? ((x - x0) / (x1 - x0)) * plotW : plotW / 2);
    const sy = (y) => PAD.top + (1 - (y - lo) / (hi - lo)) * plotH;

    ctx.strokeStyle = grid;
    ctx.lineWidth = 1;
    ctx.fillStyle = ink;
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    const yTicks = niceTicks(lo, hi, Math.max(2, Math.floor(plotH / 40)));
    const yStep = yTicks.length > 1 ? yTicks[1] - yTicks[0] : Math.abs(yTicks[0]) || 1;
    for (const t of yTicks) {
      const y = Math.round(sy(t)) + 0.5;
      ctx.beginPath();
      ctx.moveTo(PAD.left, y);
      ctx.lineTo(PAD.left + plotW, y);
      ctx.stroke();
      ctx.fillText(this.tickFormat(t, yStep), PAD.left - 6, y);
    }
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    const xTicks = x1 > x0 ? niceTicks(x0, x1, Math.max(2, Math.floor(plotW / 90))) : [x0];
    for (const t of xTicks) {
      const x = Math.round(sx(t)) + 0.5;
      ctx.beginPath();
      ctx.moveTo(x, PAD.top);
      ctx.lineTo(x, PAD.top + plotH);
      ctx.stroke();
      ctx.fillText(String(Math.round(t)), x, PAD.top + plotH + 6);
    }

    let drawn = 0;
    ctx.save();
    ctx.beginPath();
    ctx.rect(PAD.left, PAD.top, plotW, plotH);
    ctx.clip();
    for (const [s, idx] of kept) {
      ctx.strokeStyle = s.color;
      ctx.fillStyle = s.color;
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      idx.forEach((i, k) => {
        const x = sx(s.xs[i]);
        const y = sy(s.ys[i]);
        if (k === 0) ctx.moveTo(x, y);
        else ctx.lineTo(x, y);
      });
      ctx.stroke();
      if (s.dots || idx.length === 1) {
        for (const i of idx) {
          ctx.beginPath();
          ctx.arc(sx(s.xs[i]), sy(s.ys[i]), 2.5, 0, 2 * Math.PI);
          ctx.fill();
        }
      }
      drawn += idx.length;
    }
    ctx.restore();
    if (this.hoverX !== null && this.hoverX >= PAD.left && this.hoverX <= PAD.left + plotW) {
      const step = x1 > x0 ? x0 + ((this.hoverX - PAD.left) / plotW) * (x1 - x0) : x0;
      this.drawHover(ctx, step, sx, sy, { ink, plotH });
    }
    this.drawn = drawn;
    canvas.dataset.points = String(this.pointCount());
    canvas.dataset.drawn = String(drawn);
  }

  // A vertical line at the nearest step, each series' value there, in a box beside it.
  drawHover(ctx, step, sx, sy, { ink, plotH }) {
    const lines = [];
    let at = null;
    for (const s of this.series.values()) {
      const i = nearest(s.xs, s.n, step);
      if (i < 0 || !Number.isFinite(s.ys[i])) continue;
      at = at ?? s.xs[i];
      lines.push([s.color, `${s.label} ${this.format(s.ys[i])}`]);
      ctx.fillStyle = s.color;
      ctx.beginPath();
      ctx.arc(sx(s.xs[i]), sy(s.ys[i]), 3, 0, 2 * Math.PI);
      ctx.fill();
    }
    if (at === null) return;
    const x = Math.round(sx(at)) + 0.5;
    ctx.strokeStyle = ink;
    ctx.globalAlpha = 0.4;
    ctx.beginPath();
    ctx.moveTo(x, PAD.top);
    ctx.lineTo(x, PAD.top + plotH);
    ctx.stroke();
    ctx.globalAlpha = 1;
    lines.unshift([ink, `step ${Math.round(at)}`]);
    const boxW = Math.max(...lines.map(([, text]) => ctx.measureText(text).width)) + 12;
    const boxX = x + 8 + boxW < this.canvas.clientWidth ? x + 8 : x - 8 - boxW;
    ctx.fillStyle = "rgba(255, 255, 255, 0.9)";
    ctx.fillRect(boxX, PAD.top + 4, boxW, lines.length * 16 + 6);
    ctx.textAlign = "left";
    ctx.textBaseline = "top";
    lines.forEach(([color, text], k) => {
      ctx.fillStyle = color;
      ctx.fillText(text, boxX + 6, PAD.top + 8 + k * 16);
    });
  }

  // Draws the legend right-aligned on the top row; returns where it starts. `limit`: the
  // x it should not pass (the title's end): past it, the labels go without their values.
  drawLegend(ctx, width, limit) {
    const entries = [...this.series.values()].reverse().map((s) => {
      let last = NaN;
      for (let i = s.n - 1; i >= 0 && !Number.isFinite(last); i--) last = s.ys[i];
      const full = Number.isFinite(last) ? `${s.label} ${this.format(last)}` : s.label;
      return { s, full, short: s.label };
    });
    const span = (key) =>
      entries.reduce((sum, e) => sum + ctx.measureText(e[key]).width + 24, 0);
    const key = width - PAD.right - span("full") >= limit ? "full" : "short";
    this.canvas.dataset.legend = key; // for the tests: which form fit
    ctx.textAlign = "right";
    ctx.textBaseline = "alphabetic";
    let right = width - PAD.right;
    for (const e of entries) {
      ctx.fillStyle = e.s.color;
      ctx.fillText(e[key], right, 16);
      right -= ctx.measureText(e[key]).width + 10;
      ctx.fillRect(right, 10, 8, 3);
      right -= 14;
    }
    return right;
  }
}
