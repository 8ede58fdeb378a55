// Chat panel of a job's page: the base's and the fine-tuned model's answers to the same
// prompt, side by side, streamed from POST /v1/chat/completions (docs/CHAT.md).
//
// Shown once the job succeeded. The fine-tuned side asks the job's model id; the base
// side asks the model folder the job trained on, found in GET /v1/models (a preset has no
// trained weights to answer with: that side says so).

import { ApiError, SseParser, api, authFetch } from "../api.js";
import { describeError, el } from "../format.js";

// The base model's id: the longest listed name that the job's model path ends with.
export function baseModelId(spec, modelIds) {
  const path = spec?.model?.path;
  if (!path) return null;
  const names = modelIds.filter((id) => path === id || path.endsWith("/" + id));
  return names.sort((a, b) => b.length - a.length)[0] || null;
}

// Streams one answer into `out`; resolves with the finish reason.
async function ask(model, messages, maxTokens, out, signal) {
  const response = await authFetch("/v1/chat/completions", {
    method: "POST",
    headers: { "Content-Type": "application/json", Accept: "text/event-stream" },
    body: JSON.stringify({
      model,
      messages,
      temperature: 0,
      max_completion_tokens: maxTokens,
      stream: true,
    }),
    signal,
  });
  if (!response.ok) {
    let body = null;
    try {
      body = await response.json();
    } catch {
      body = null;
    }
    throw new ApiError(response.status, body);
  }
  let finish = null;
  let failure = null;
  const parser = new SseParser(
    (event) => {
      if (event.data === "[DONE]") return;
      const chunk = JSON.parse(event.data);
      if (chunk.error) {
        failure = new ApiError(500, chunk);
        return;
      }
      const choice = chunk.choices?.[0];
      if (choice?.delta?.content) out.append(choice.delta.content);
      if (choice?.finish_reason) finish = choice.finish_reason;
    },
    () => {},
  );
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    parser.feed(value);
  }
  if (failure) throw failure;
  return finish;
}

export function chatPanel(jobId) {
  const prompt = el("textarea", {
    id: "chat-prompt",
    rows: 3,
    placeholder: "Ask both models the same question",
  });
  const maxTokens = el("input", { id: "chat-max-tokens", type: "number", min: 1, value: 128 });
  const send = el("button", { type: "submit", id: "chat-send" }, "Ask both");
  const side = (name) => {
    const label = el("span", { class: "muted small", id: `chat-${name}-model` });
    const out = el("pre", { id: `chat-${name}`, class: "log chat-answer" });
    return { label, out, node: el("div", {}, el("h3", {}, name === "base" ? "Base " : "Fine-tuned ", label), out) };
  };
  const base = side("base");
  const tuned = side("tuned");
  const form = el(
    "form",
    { id: "chat-form", class: "chat-form" },
    prompt,
    el("label", { class: "small" }, "max tokens ", maxTokens),
    send,
  );
  const node = el(
    "section",
    { id: "chat-panel", hidden: true },
    el("h2", {}, "Chat"),
    form,
    el("section", { class: "two" }, base.node, tuned.node),
  );
  let models = null; // {base, tuned}
  let running = null;

  async function answer(target, model, messages) {
    target.out.replaceChildren();
    target.out.dataset.state = "asking";
    if (!model) {
      target.out.textContent = "The job trained a preset's random initialisation: no base model to ask.";
      target.out.dataset.state = "none";
      return;
    }
    try {
      const finish = await ask(model, messages, Number(maxTokens.value) || 128, target.out, running.signal);
      target.out.dataset.finish = finish || "";
      target.out.dataset.state = "done";
    } catch (failure) {
      if (running.signal.aborted) return;
      target.out.textContent = describeError(failure, "Chat");
      target.out.dataset.state = "error";
    }
  }

  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    if (!models || !prompt.value.trim()) return;
    if (running) running.abort();
    running = new AbortController();
    const messages = [{ role: "user", content: prompt.value }];
    send.disabled = true;
    try {
      await Promise.all([answer(base, models.base, messages), answer(tuned, models.tuned, messages)]);
    } finally {
      send.disabled = false;
    }
  });

  // Called with the job whenever the page has a fresh copy of it.
  async function update(job) {
    if (models || job.status !== "succeeded") return;
    models = { tuned: jobId, base: null };
    node.hidden = false;
    tuned.label.textContent = jobId;
    try {
      const listed = await api("/v1/models");
      const ids = listed.data.map((m) => m.id);
      models.tuned = ids.find((id) => id.startsWith("ft:") && id.endsWith(":" + jobId)) || jobId;
      models.base = baseModelId(job.spec, ids);
    } catch {
      // the ids above still answer; the base stays unknown
    }
    tuned.label.textContent = models.tuned;
    base.label.textContent = models.base || "(a preset)";
  }

  return { node, update, close: () => running && running.abort() };
}
