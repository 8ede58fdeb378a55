// New job: a JobSpec in YAML or JSON (typed, pasted, opened, or the demo), a dataset upload.

import { api } from "../api.js";
import { describeError, el, integer } from "../format.js";
import { DRAFT_KEY } from "./job.js";
import { YAMLException, dump, load } from "../vendor/js-yaml.min.mjs";

export function renderNewJob(view) {
  const spec = el("textarea", {
    id: "spec",
    spellcheck: "false",
    rows: 28,
    "aria-label": "JobSpec (YAML or JSON)",
    placeholder: "model:\n  preset: qwen3\ndata:\n  train: synthetic\n…  (YAML or JSON; see docs/API.md)",
  });
  const specFile = el("input", { type: "file", id: "spec-file", accept: ".yaml,.yml,.json" });
  const specErrors = el("div", { id: "spec-errors", class: "error", role: "alert" });
  const dataFile = el("input", { type: "file", id: "data-file", accept: ".jsonl,.json,.txt" });
  const format = el(
    "select",
    { id: "data-format", "aria-label": "Dataset format" },
    ["auto", "text", "chat", "prompt_completion", "preference", "prompt"].map((f) => el("option", { value: f }, f)),
  );
  const uploadResult = el("div", { id: "upload-result", role: "alert" });

  view.append(
    el("h1", {}, "New job"),
    el(
      "section",
      { class: "two" },
      el(
        "div",
        {},
        el(
          "div",
          { class: "toolbar" },
          el("button", { type: "button", id: "load-demo", onclick: loadDemo }, "Start from the demo spec"),
          el("label", { class: "button" }, "Open a YAML/JSON file… ", specFile),
        ),
        spec,
        specErrors,
        el("button", { type: "button", id: "submit-job", class: "primary", onclick: submit }, "Submit job"),
      ),
      el(
        "div",
        {},
        el("h2", {}, "Dataset"),
        el(
          "p",
          { class: "muted" },
          'A .jsonl file, one object a line: {"text"}, {"messages"} or {"prompt", "completion"}. The daemon checks every line; the first bad one is named.',
        ),
        el(
          "div",
          { class: "toolbar" },
          dataFile,
          format,
          el("button", { type: "button", id: "upload-data", onclick: upload }, "Upload"),
        ),
        uploadResult,
      ),
    ),
  );

  // A spec handed over by a job page's "Edit as a new job".
  const draft = sessionStorage.getItem(DRAFT_KEY);
  if (draft !== null) {
    sessionStorage.removeItem(DRAFT_KEY);
    spec.value = draft;
  }

  // One Idempotency-Key per spec text: a double click or a retry of the same text returns
  // the job already made instead of a second one; an edited spec gets a new key.
  let idempotencyKey = newKey();
  spec.addEventListener("input", () => {
    idempotencyKey = newKey();
  });

  specFile.addEventListener("change", async () => {
    const file = specFile.files[0];
    if (file) spec.value = await file.text();
    idempotencyKey = newKey();
    specFile.value = "";
  });

  async function loadDemo() {
    try {
      spec.value = dump(await api("/v1/demo"), { lineWidth: 100 });
      idempotencyKey = newKey();
      specErrors.replaceChildren();
    } catch (failure) {
      specErrors.textContent = describeError(failure, "Loading the demo spec");
    }
  }

  // The text as an object, or null with the parse error shown (line and column).
  function parsed() {
    try {
      const value = load(spec.value);
      if (value === null || typeof value !== "object" || Array.isArray(value)) {
        specErrors.textContent = "The JobSpec must be a mapping (model:, data:, train:, …).";
        return null;
      }
      return value;
    } catch (failure) {
      if (failure instanceof YAMLException && failure.mark) {
        specErrors.textContent = `Line ${failure.mark.line + 1}, column ${failure.mark.column + 1}: ${failure.reason}`;
      } else {
        specErrors.textContent = `Not valid YAML or JSON: ${failure.message}`;
      }
      return null;
    }
  }

  async function submit() {
    specErrors.replaceChildren();
    const body = parsed();
    if (!body) return;
    try {
      const job = await api("/v1/jobs", {
        method: "POST",
        json: body,
        headers: { "Idempotency-Key": idempotencyKey },
      });
      location.hash = `#/jobs/${encodeURIComponent(job.id)}`;
    } catch (failure) {
      showError(specErrors, failure, "Submit");
    }
  }

  async function upload() {
    uploadResult.replaceChildren();
    uploadResult.className = "";
    const file = dataFile.files[0];
    if (!file) {
      uploadResult.className = "error";
      uploadResult.textContent = "Choose a .jsonl file first.";
      return;
    }
    const form = new FormData();
    form.append("file", file);
    form.append("format", format.value);
    try {
      const record = await api("/v1/files", { method: "POST", body: form });
      uploadResult.className = "ok";
      uploadResult.append(
        `Uploaded ${record.id}: ${integer(record.line_count)} lines, format ${record.format}. `,
        el("button", { type: "button", id: "use-file", onclick: () => useFile(record) }, "Use as data.train"),
      );
    } catch (failure) {
      showError(uploadResult, failure, "Upload", await lineOf(file, failure.details?.line));
    }
  }

  // Puts the uploaded file's id into the spec (rewritten as YAML: comments are dropped).
  function useFile(record) {
    const body = spec.value.trim() ? parsed() : {};
    if (!body) return;
    body.data = { ...(body.data || {}), train: record.id, format: record.format };
    spec.value = dump(body, { lineWidth: 100 });
    idempotencyKey = newKey();
  }
}

// crypto.randomUUID needs a secure context; a daemon reached over plain http on the LAN is not.
function newKey() {
  const bytes = crypto.getRandomValues(new Uint8Array(16));
  return "dashboard-" + Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

// The envelope's message, then one line per detail (field or file line) when there are several.
// The text of a file's 1-based line `n` (cut to 300 characters), or null.
async function lineOf(file, n) {
  if (!Number.isInteger(n) || n < 1 || file.size > 64 * 1024 * 1024) return null;
  const line = (await file.text()).split(/\r?\n/)[n - 1];
  return line === undefined ? null : line.length > 300 ? line.slice(0, 300) + "…" : line;
}

// `quoted`: the bad line itself, shown under its number when the file is at hand.
function showError(target, failure, action, quoted = null) {
  target.className = "error";
  const items = [];
  const details = failure.details;
  if (details && !Array.isArray(details) && details.line) {
    items.push(
      el(
        "li",
        { dataset: { line: details.line } },
        `line ${details.line}`,
        quoted === null ? "" : el("pre", { class: "bad-line" }, quoted),
      ),
    );
  } else if (Array.isArray(details) && details.length > 1) {
    for (const d of details) items.push(el("li", {}, d.param ? `${d.param}: ${d.message}` : d.message));
  }
  target.replaceChildren(
    el("p", {}, describeError(failure, action)),
    items.length ? el("ul", {}, items) : "",
  );
}
