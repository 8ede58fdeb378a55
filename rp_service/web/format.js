// Formatting numbers and building DOM nodes; text always goes in as text, never as HTML.

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else if (name === "class") node.className = value;
    else if (name === "dataset") Object.assign(node.dataset, value);
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

export const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
export const STATUSES = [
  "validating",
  "queued",
  "running",
  "pausing",
  "paused",
  "cancelling",
  "cancelled",
  "succeeded",
  "failed",
];

export function number(value, digits = 4) {
  if (value === null || value === undefined || !Number.isFinite(value)) return "–";
  if (value !== 0 && (Math.abs(value) >= 1e5 || Math.abs(value) < 1e-3)) {
    return value.toExponential(2);
  }
  return String(Number(value.toPrecision(digits)));
}

export function integer(value) {
  if (value === null || value === undefined || !Number.isFinite(value)) return "–";
  return Math.round(value).toLocaleString("en-US");
}

export function bytes(value) {
  if (value === null || value === undefined || !Number.isFinite(value)) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let v = value;
  let u = 0;
  while (Math.abs(v) >= 1024 && u < units.length - 1) {
    v /= 1024;
    u += 1;
  }
  return `${u === 0 ? v : v.toFixed(1)} ${units[u]}`;
}

export function duration(seconds) {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) return "–";
  const s = Math.max(0, Math.round(seconds));
  const h = Math.floor(s / 3600);
  const m = Math.floor((s % 3600) / 60);
  if (h > 0) return `${h}h ${String(m).padStart(2, "0")}m`;
  if (m > 0) return `${m}m ${String(s % 60).padStart(2, "0")}s`;
  return `${s}s`;
}

export function time(unixSeconds) {
  if (!unixSeconds) return "–";
  return new Date(unixSeconds * 1000).toLocaleString();
}

export function statusBadge(status) {
  return el("span", { class: `badge status-${status}`, dataset: { status } }, status);
}

// "step 40 / 300" with a bar.
export function progressBar(progress) {
  const step = progress?.step ?? 0;
  const total = progress?.total_steps;
  const fraction = total ? Math.min(1, step / total) : 0;
  const bar = el("span", { class: "bar" }, el("span", { class: "fill" }));
  bar.firstChild.style.width = `${(fraction * 100).toFixed(1)}%`;
  return el("span", { class: "progress" }, bar, ` ${integer(step)} / ${total ? integer(total) : "?"}`);
}

// An ApiError as a sentence for people: what the daemon said, with its status and code.
export function describeError(error, action) {
  if (error && error.status) {
    const what = error.status === 409 ? "refused" : "failed";
    const param = error.param ? ` [${error.param}]` : "";
    return `${action} ${what} (${error.status} ${error.code}): ${error.message}${param}`;
  }
  return `${action} failed: ${error && error.message ? error.message : error}`;
}
