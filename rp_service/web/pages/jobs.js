// Jobs: every job with status, progress, loss, tokens/s and ETA; polled; filter by status.

import { api } from "../api.js";
import { STATUSES, describeError, duration, el, number, progressBar, statusBadge, time } from "../format.js";

const POLL_MS = 2000;
const PAGE = 100;

export function renderJobs(view) {
  const params = new URLSearchParams(location.hash.split("?")[1] || "");
  const filter = el(
    "select",
    { id: "status-filter", "aria-label": "Filter by status" },
    el("option", { value: "" }, "all statuses"),
    STATUSES.map((s) => el("option", { value: s }, s)),
  );
  filter.value = params.get("status") || "";
  const body = el("tbody");
  const note = el("p", { class: "muted", id: "jobs-note" });
  const more = el("button", { type: "button", hidden: true }, "Show more");
  const error = el("p", { class: "error", role: "alert" });
  view.append(
    el(
      "div",
      { class: "toolbar" },
      el("h1", {}, "Jobs"),
      filter,
      el("a", { class: "button", href: "#/new" }, "New job"),
    ),
    error,
    el(
      "table",
      { class: "jobs", id: "jobs-table" },
      el(
        "thead",
        {},
        el(
          "tr",
          {},
          ["Job", "Status", "Progress", "Loss", "Tokens/s", "ETA", "Created"].map((h) => el("th", {}, h)),
        ),
      ),
      body,
    ),
    note,
    more,
  );

  let pages = 1; // how many pages of PAGE jobs to show; "Show more" adds one
  let timer = null;
  let stopped = false;

  async function load() {
    const status = filter.value;
    const jobs = [];
    let after = null;
    let hasMore = false;
    for (let p = 0; p < pages; p++) {
      const query = new URLSearchParams({ limit: String(PAGE) });
      if (status) query.set("status", status);
      if (after) query.set("after", after);
      const page = await api(`/v1/jobs?${query}`);
      jobs.push(...page.data);
      hasMore = page.has_more;
      after = page.last_id;
      if (!hasMore) break;
    }
    body.replaceChildren(...jobs.map(row));
    note.textContent = jobs.length
      ? ""
      : status
        ? `No ${status} jobs.`
        : "No jobs yet: submit one from New job.";
    more.hidden = !hasMore;
  }

  async function tick() {
    if (stopped) return;
    try {
      await load();
      error.textContent = "";
    } catch (failure) {
      error.textContent = describeError(failure, "Listing jobs");
    }
    if (!stopped) timer = setTimeout(tick, POLL_MS);
  }

  filter.addEventListener("change", () => {
    const query = filter.value ? `?status=${filter.value}` : "";
    history.replaceState(null, "", `#/jobs${query}`);
    clearTimeout(timer);
    tick();
  });
  more.addEventListener("click", () => {
    pages += 1;
    clearTimeout(timer);
    tick();
  });
  tick();
  return () => {
    stopped = true;
    clearTimeout(timer);
  };
}

function row(job) {
  const link = el("a", { href: `#/jobs/${encodeURIComponent(job.id)}` }, job.name || job.id);
  return el(
    "tr",
    { dataset: { jobId: job.id, status: job.status } },
    el("td", {}, link, el("div", { class: "muted small" }, job.id)),
    el("td", {}, statusBadge(job.status)),
    el("td", {}, progressBar(job.progress)),
    el("td", { class: "num" }, number(job.metrics?.train_loss)),
    el("td", { class: "num" }, number(job.metrics?.tokens_per_second, 3)),
    el("td", { class: "num" }, job.status === "running" ? duration(job.progress?.eta_seconds) : "–"),
    el("td", {}, time(job.created_at)),
  );
}
