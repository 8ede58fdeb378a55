// System: versions, devices, memory, the C Adam build, the queue, each GPU's job and
// busy share, and the Ray cluster's nodes (GET /v1/system, polled).

import { api } from "../api.js";
import { bytes, describeError, el, integer, statusBadge } from "../format.js";

const POLL_MS = 5000;

export function renderSystem(view) {
  const content = el("div", { id: "system" });
  const error = el("p", { class: "error", role: "alert" });
  view.append(el("h1", {}, "System"), error, content);
  let timer = null;
  let stopped = false;

  async function tick() {
    try {
      show(await api("/v1/system"));
      error.textContent = "";
    } catch (failure) {
      error.textContent = describeError(failure, "Reading /v1/system");
    }
    if (!stopped) timer = setTimeout(tick, POLL_MS);
  }

  function show(system) {
    const devices = system.devices.length
      ? el(
          "table",
          { id: "devices" },
          el(
            "thead",
            {},
            el(
              "tr",
              {},
              ["GPU", "Name", "Memory", "Capability"].map((h) => el("th", {}, h)),
            ),
          ),
          el(
            "tbody",
            {},
            system.devices.map((d) =>
              el(
                "tr",
                {},
                el("td", {}, String(d.index)),
                el("td", {}, d.name),
                el("td", { class: "num" }, bytes(d.total_memory_bytes)),
                el("td", {}, d.capability ?? "–"),
              ),
            ),
          ),
        )
      : el(
          "p",
          { id: "devices", class: "muted" },
          "No GPU visible to the daemon: jobs run on virtual CPU devices (RP_CPU_DEVICES).",
        );
    const adam = system.adam
      ? keyValues("adam", Object.entries(system.adam))
      : el("p", { id: "adam", class: "muted" }, "not built: the optimizer falls back to torch");
    const jobs = Object.entries(system.jobs || {});
    content.replaceChildren(
      el(
        "dl",
        { class: "summary" },
        el("dt", {}, "version"),
        el("dd", {}, system.version),
        // host_memory_bytes, pinned_budget_bytes and any other byte count the daemon reports
        Object.entries(system)
          .filter(([key, value]) => key.endsWith("_bytes") && (value === null || typeof value === "number"))
          .flatMap(([key, value]) => [
            el("dt", {}, key.replace(/_bytes$/, "").replaceAll("_", " ")),
            el("dd", {}, bytes(value)),
          ]),
        el("dt", {}, "queue"),
        el("dd", { id: "queue" }, `${system.queue_length} queued`),
        el("dt", {}, "jobs"),
        el(
          "dd",
          {},
          jobs.length
            ? jobs.map(([s, n]) => el("span", { class: "count" }, statusBadge(s), ` ${n} `))
            : "none",
        ),
      ),
      el("h2", {}, "Devices"),
      devices,
      el("h2", {}, "GPU share"),
      shareTable(system.gpu_share || []),
      ...(system.cluster ? [el("h2", {}, "Cluster"), clusterTable(system.cluster)] : []),
      el("h2", {}, "C Adam"),
      adam,
      el("h2", {}, "Versions"),
      keyValues(
        "versions",
        Object.entries(system.versions).map(([k, v]) => [k, v ?? "not installed"]),
      ),
    );
  }

  tick();
  return () => {
    stopped = true;
    clearTimeout(timer);
  };
}

// Each GPU (or a CPU job's virtual device): the job holding it and the share of the job's
// latest step it was busy computing (docs/PERFORMANCE.md, "Each GPU's share of a job").
function shareTable(rows) {
  if (!rows.length) {
    return el("p", { id: "gpu-share", class: "muted" }, "No GPU, and no job running on the CPU.");
  }
  return el(
    "table",
    { id: "gpu-share" },
    el(
      "thead",
      {},
      el("tr", {}, ["Device", "Job", "Busy", "Step", "Engine jobs"].map((h) => el("th", {}, h))),
    ),
    el(
      "tbody",
      {},
      rows.map((row) =>
        el(
          "tr",
          { dataset: { device: row.device } },
          el("td", {}, row.device),
          el(
            "td",
            {},
            row.job_id
              ? el("a", { href: `#/jobs/${encodeURIComponent(row.job_id)}` }, row.job_id)
              : "free",
          ),
          el("td", { class: "num" }, busy(row.busy_fraction)),
          el("td", { class: "num" }, row.step == null ? "–" : integer(row.step)),
          el("td", { class: "num" }, row.jobs == null ? "–" : integer(row.jobs)),
        ),
      ),
    ),
  );
}

// The Ray cluster of multi-node jobs (RP_RAY_ADDRESS; docs/SCALING.md): each live node's
// GPUs, CPUs and host memory, and the jobs with a rank on it.
function clusterTable(cluster) {
  const head = el(
    "p",
    { class: cluster.error ? "error" : "muted" },
    cluster.error
      ? `${cluster.address}: unreachable (${cluster.error})`
      : `${cluster.address}: ${cluster.nodes.length} nodes`,
  );
  const table = el(
    "table",
    { id: "cluster-nodes" },
    el(
      "thead",
      {},
      el("tr", {}, ["Node", "Address", "GPUs", "CPUs", "Memory", "Jobs"].map((h) => el("th", {}, h))),
    ),
    el(
      "tbody",
      {},
      cluster.nodes.map((node) =>
        el(
          "tr",
          { dataset: { node: node.node_id } },
          el("td", {}, node.node_id.slice(0, 12)),
          el("td", {}, node.address ?? "–"),
          el("td", { class: "num" }, integer(node.gpus)),
          el("td", { class: "num" }, integer(node.cpus)),
          el("td", { class: "num" }, bytes(node.memory_bytes)),
          el(
            "td",
            {},
            node.jobs.length
              ? node.jobs.map((id) => el("a", { href: `#/jobs/${encodeURIComponent(id)}` }, id, " "))
              : "free",
          ),
        ),
      ),
    ),
  );
  return el("div", { id: "cluster" }, head, table);
}

function busy(fraction) {
  if (fraction == null) return "–";
  const bar = el("span", { class: "bar" }, el("span", { class: "fill" }));
  bar.firstChild.style.width = `${(Math.min(1, fraction) * 100).toFixed(1)}%`;
  return el("span", {}, bar, ` ${Math.round(fraction * 100)}%`);
}

function keyValues(id, pairs) {
  return el(
    "table",
    { id, class: "pairs" },
    el(
      "tbody",
      {},
      pairs.map(([k, v]) => el("tr", {}, el("th", {}, k), el("td", {}, String(v)))),
    ),
  );
}
