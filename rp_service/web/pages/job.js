// Job: live charts from the job's event stream, samples, events, worker log, checkpoints,
// controls.

import { ApiError, JobEventStream, api, authFetch, download } from "../api.js";
import { LineChart, Series } from "../chart.js";
import { dump } from "../vendor/js-yaml.min.mjs";
import {
  TERMINAL,
  bytes,
  describeError,
  duration,
  el,
  integer,
  number,
  progressBar,
  statusBadge,
  time,
} from "../format.js";
import { chatPanel } from "./chat.js";
import { preferenceCharts, preferenceSummary } from "./preference.js";
import { rewardCharts, rewardSummary } from "./rewards.js";
import { samplesPanel } from "./samples.js";

// The statuses each control applies to (the orchestrator's transitions).
const ALLOWED = {
  pause: (status) => status === "queued" || status === "running",
  resume: (status) => status === "paused",
  cancel: (status) => !TERMINAL.has(status) && status !== "cancelling",
};

const POLL_MS = 2000;
export const DRAFT_KEY = "rp.draft";
const MAX_EVENT_ROWS = 300;
const MAX_LOG_CHARS = 200000;
const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c"];
// Memory columns of a metrics event: gpu_mem_bytes, and any other *_mem_bytes a worker adds.
const MEMORY_KEY = /_mem(ory)?_bytes$/;

export function renderJob(view, jobId) {
  const path = `/v1/jobs/${encodeURIComponent(jobId)}`;
  const title = el("h1", {}, jobId);
  const badge = el("span", { id: "job-status" });
  const streamState = el("span", { id: "stream-state", class: "muted small" }, "connecting");
  const message = el("p", { id: "action-message", role: "alert" });
  const summary = el("dl", { class: "summary", id: "job-summary" });
  const specText = el("pre", { class: "spec" });
  const specBox = el("details", { id: "job-spec" }, el("summary", {}, "JobSpec"), specText);
  const cloneButton = el(
    "button",
    { type: "button", id: "clone-button", onclick: () => clone() },
    "Edit as a new job",
  );

  const buttons = ["pause", "resume", "cancel"].map((action) =>
    el(
      "button",
      {
        type: "button",
        id: `${action}-button`,
        dataset: { action },
        onclick: () => act(action),
      },
      action[0].toUpperCase() + action.slice(1),
    ),
  );

  const canvas = (id) => el("canvas", { id, class: "chart" });
  const lossCanvas = canvas("chart-loss");
  const lrCanvas = canvas("chart-lr");
  const speedCanvas = canvas("chart-speed");
  const memoryCanvas = canvas("chart-memory");
  const charts = {
    loss: new LineChart(lossCanvas, {
      title: "loss",
      format: (v) => number(v, 3),
      series: [
        new Series("train_loss", "train", COLORS[0]),
        new Series("valid_loss", "valid", COLORS[1], { dots: true }),
      ],
    }),
    lr: new LineChart(lrCanvas, {
      title: "learning rate",
      format: (v) => number(v, 2),
      series: [new Series("learning_rate", "lr", COLORS[2])],
    }),
    speed: new LineChart(speedCanvas, {
      title: "tokens/s",
      format: (v) => number(v, 3),
      series: [new Series("tokens_per_second", "tokens/s", COLORS[3])],
    }),
    memory: new LineChart(memoryCanvas, {
      title: "memory",
      format: bytes,
      tickFormat: bytes,
      series: [],
      empty: "no memory in use reported (a CPU run reports no GPU memory)",
    }),
  };

  const preference = preferenceCharts(lossCanvas); // a DPO job's reward charts (pages/preference.js)
  const rewards = rewardCharts(lossCanvas); // a GRPO job's reward charts (pages/rewards.js)

  const checkpointsBody = el("tbody");
  const eventsList = el("ol", { id: "events", class: "events", reversed: true });
  const showMetrics = el("input", { type: "checkbox", id: "show-metrics" });
  const log = el("pre", { id: "worker-log", class: "log" });
  const chat = chatPanel(jobId); // shown once the job succeeded (pages/chat.js)
  const samples = samplesPanel(); // completions at each evaluation (pages/samples.js)

  view.append(
    el(
      "div",
      { class: "toolbar" },
      el("a", { href: "#/jobs" }, "← Jobs"),
      title,
      badge,
      ...buttons,
      cloneButton,
      streamState,
    ),
    message,
    summary,
    specBox,
    el("section", { class: "charts" }, lossCanvas, lrCanvas, speedCanvas, memoryCanvas),
    samples.node,
    el("h2", {}, "Checkpoints"),
    el(
      "table",
      { id: "checkpoints" },
      el(
        "thead",
        {},
        el(
          "tr",
          {},
          ["Step", "Created", "Size", "Loss", ""].map((h) => el("th", {}, h)),
        ),
      ),
      checkpointsBody,
    ),
    el(
      "section",
      { class: "two" },
      el(
        "div",
        {},
        el("h2", {}, "Events ", el("label", { class: "small" }, showMetrics, " show metrics")),
        eventsList,
      ),
      el("div", {}, el("h2", {}, "Worker log"), log),
    ),
    chat.node,
  );

  let job = null;
  let stopped = false;
  let pollTimer = null;
  let logOffset = 0;
  let lastCheckpointLoad = 0;

  function showJob(next) {
    job = next;
    title.textContent = job.name ? `${job.name}` : job.id;
    badge.replaceChildren(statusBadge(job.status));
    // each control only where the API allows it (it would refuse the others with a 409)
    for (const button of buttons) button.disabled = !ALLOWED[button.dataset.action](job.status);
    const m = job.metrics || {};
    const p = job.progress || {};
    const rows = [
      ["id", job.id],
      ["progress", progressBar(p)],
      ["train loss", number(m.train_loss)],
      ["valid loss", number(m.valid_loss)],
      ...preferenceSummary(m),
      ...rewardSummary(m),
      ["learning rate", number(m.learning_rate, 3)],
      ["tokens/s", number(m.tokens_per_second, 3)],
      ["ETA", job.status === "running" ? duration(p.eta_seconds) : "–"],
      ["trained tokens", integer(job.trained_tokens)],
      ["attempt", String(job.attempt)],
      ["GPUs", job.gpus.length ? job.gpus.join(", ") : "–"],
      ["created", time(job.created_at)],
      ["started", time(job.started_at)],
      ["finished", time(job.finished_at)],
    ];
    if (job.gpu_mode) rows.push(["GPU mode", gpuMode(job.gpu_mode)]);
    if (job.output_model_path) rows.push(["model", job.output_model_path]);
    if (job.error)
      rows.push(["error", el("span", { class: "error" }, `${job.error.code}: ${job.error.message}`)]);
    summary.replaceChildren(...rows.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, v)]));
    if (!specText.textContent) specText.textContent = dump(job.spec, { lineWidth: 100 });
    chat.update(job);
    samples.show(job.spec);
  }

  async function refreshJob() {
    showJob(await api(path));
  }

  // Between polls the summary follows the stream (redrawn at most once a frame).
  let summaryPending = false;
  function followMetrics(data) {
    // events replayed from the start must not move the summary back; the poll corrects it
    if (!job || TERMINAL.has(job.status) || data.step < (job.progress?.step ?? 0)) return;
    job.progress = {
      ...job.progress,
      step: data.step,
      total_steps: data.total_steps ?? job.progress.total_steps,
      eta_seconds: data.eta_seconds ?? null,
    };
    job.metrics = {
      ...job.metrics,
      ...Object.fromEntries(Object.entries(data).filter(([, v]) => v !== null)),
    };
    if (typeof data.trained_tokens === "number") job.trained_tokens = data.trained_tokens;
    if (summaryPending) return;
    summaryPending = true;
    requestAnimationFrame(() => {
      summaryPending = false;
      showJob(job);
    });
  }

  // The New job page opens with this job's spec in its editor.
  function clone() {
    if (!job) return;
    sessionStorage.setItem(DRAFT_KEY, dump(job.spec, { lineWidth: 100 }));
    location.hash = "#/new";
  }

  async function act(action) {
    if (action === "cancel" && !confirm(`Cancel ${job ? job.name || job.id : jobId}? This cannot be undone.`))
      return;
    message.className = "";
    message.textContent = `${action}…`;
    try {
      showJob(await api(`${path}/${action}`, { method: "POST" }));
      message.className = "ok";
      message.textContent = `${action[0].toUpperCase() + action.slice(1)} accepted: the job is ${job.status}.`;
    } catch (failure) {
      message.className = "error";
      message.textContent = describeError(failure, action[0].toUpperCase() + action.slice(1));
    }
  }

  function onMetrics(data) {
    const step = data.step;
    if (typeof step !== "number") return;
    for (const [chart, key] of [
      [charts.loss, "train_loss"],
      [charts.loss, "valid_loss"],
      [charts.lr, "learning_rate"],
      [charts.speed, "tokens_per_second"],
    ]) {
      if (typeof data[key] === "number") chart.push(key, step, data[key]);
    }
    preference.onMetrics(data, step);
    rewards.onMetrics(data, step);
    for (const [key, value] of Object.entries(data)) {
      if (!MEMORY_KEY.test(key) || typeof value !== "number") continue;
      // a column that has only ever been 0 (GPU memory of a CPU run) is left out
      if (value === 0 && !charts.memory.series.has(key)) continue;
      const label = key.replace(MEMORY_KEY, "");
      charts.memory.ensure(
        key,
        () => new Series(key, label, COLORS[charts.memory.series.size % COLORS.length]),
      );
      charts.memory.push(key, step, value);
    }
  }

  function addEventRow(event) {
    const row = el(
      "li",
      {
        class: `event level-${event.level} type-${event.type}`,
        dataset: { eventId: event.id, type: event.type },
      },
      el(
        "span",
        { class: "muted small" },
        `#${event.id} ${new Date(event.created_at * 1000).toLocaleTimeString()}`,
      ),
      " ",
      el("span", { class: "small" }, event.type),
      " ",
      event.message,
    );
    eventsList.prepend(row);
    while (eventsList.childElementCount > MAX_EVENT_ROWS) eventsList.lastElementChild.remove();
  }

  function onEvent(event) {
    if (event.type === "metrics") {
      onMetrics(event.data);
      followMetrics(event.data);
    }
    if (event.type === "sample") samples.add(event);
    if (event.type !== "metrics" || showMetrics.checked) addEventRow(event);
    if (event.type === "status" && job) refreshJob().catch(() => {});
    if (event.type === "checkpoint") loadCheckpoints();
  }

  async function loadCheckpoints() {
    // a burst of checkpoint events while catching up needs one request, not one each
    const now = Date.now();
    if (now - lastCheckpointLoad < 500) return;
    lastCheckpointLoad = now;
    try {
      const page = await api(`${path}/checkpoints`);
      checkpointsBody.replaceChildren(
        ...page.data.map((c) =>
          el(
            "tr",
            { dataset: { step: c.step } },
            el("td", { class: "num" }, String(c.step)),
            el("td", {}, time(c.created_at)),
            el("td", { class: "num" }, bytes(c.size_bytes)),
            el("td", { class: "num" }, number(c.metrics?.train_loss)),
            el(
              "td",
              {},
              el(
                "button",
                { type: "button", class: "link", onclick: () => fetchCheckpoint(c.step) },
                "download .tar",
              ),
            ),
          ),
        ),
      );
      if (!page.data.length)
        checkpointsBody.replaceChildren(el("tr", {}, el("td", { colspan: 5, class: "muted" }, "none yet")));
    } catch (failure) {
      message.className = "error";
      message.textContent = describeError(failure, "Listing checkpoints");
    }
  }

  async function fetchCheckpoint(step) {
    try {
      await download(`${path}/checkpoints/${step}/content`, `${jobId}-step${step}.tar`);
    } catch (failure) {
      message.className = "error";
      message.textContent = describeError(failure, "Download");
    }
  }

  // One log read at a time: poll() and the stream's end both read the log, and two reads
  // from one offset would append the same lines twice.
  let logReads = Promise.resolve();
  function readLog() {
    const read = logReads.then(readLogOnce);
    logReads = read.catch(() => {});
    return read;
  }

  async function readLogOnce() {
    const response = await authFetch(`${path}/logs?offset=${logOffset}`);
    if (!response.ok) return;
    const text = await response.text();
    logOffset = Number(response.headers.get("x-next-offset") || logOffset);
    if (!text) return;
    const atBottom = log.scrollTop + log.clientHeight >= log.scrollHeight - 4;
    log.textContent = (log.textContent + text).slice(-MAX_LOG_CHARS);
    if (atBottom) log.scrollTop = log.scrollHeight;
  }

  // The header and log are polled; the charts and events come from the stream.
  async function poll() {
    if (stopped) return;
    try {
      await refreshJob();
      await readLog();
    } catch (failure) {
      if (failure instanceof ApiError && failure.status === 404) {
        message.className = "error";
        message.textContent = `No job ${jobId} on this daemon.`;
        return;
      }
    }
    if (!stopped && !(job && TERMINAL.has(job.status) && streamDone)) pollTimer = setTimeout(poll, POLL_MS);
  }

  let streamDone = false;
  const stream = new JobEventStream(jobId, {
    onEvent,
    onDone: () => {
      streamDone = true;
      streamState.textContent = "ended";
      streamState.dataset.state = "ended";
      refreshJob()
        .then(readLog)
        .catch(() => {});
    },
    onState: (state, detail) => {
      streamState.dataset.state = state;
      streamState.textContent =
        state === "live" ? "● live" : state === "reconnecting" ? "reconnecting…" : detail || state;
    },
  }).start();

  poll();
  loadCheckpoints();
  return () => {
    stopped = true;
    clearTimeout(pollTimer);
    stream.close();
    chat.close();
  };
}

// How the job runs on its GPUs and why (the job object's gpu_mode), as `rp status` says it.
function gpuMode(mode) {
  const ranks = mode.mode === "ranks" ? ` x ${mode.ranks}` : "";
  const overlap = mode.overlap_calls ? ", calls overlapped" : "";
  return `${mode.mode}${ranks}${overlap}: ${mode.reason}`;
}
