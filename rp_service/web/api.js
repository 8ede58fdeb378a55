// The daemon's public REST API as seen from the page: bearer token, error envelope, SSE.
//
// The token lives in this tab's sessionStorage only: it is sent in the Authorization
// header, never in a URL (URLs end up in access logs and in the browser's history).

const TOKEN_KEY = "rp.token";

export class ApiError extends Error {
  // One error envelope: {"error": {"type", "code", "message", "param", "details"}}.
  constructor(status, body) {
    const err = (body && body.error) || {};
    super(err.message || `HTTP ${status}`);
    this.status = status;
    this.code = err.code || "http_" + status;
    this.param = err.param || null;
    this.details = err.details ?? null;
  }
}

export const token = {
  get: () => sessionStorage.getItem(TOKEN_KEY),
  set: (value) => sessionStorage.setItem(TOKEN_KEY, value),
  clear: () => sessionStorage.removeItem(TOKEN_KEY),
};

// Called on a 401: resolves once a token the daemon accepts is stored. The app installs
// its dialog here; all requests refused at the same time wait on one prompt.
let askForToken = async () => {
  throw new ApiError(401, { error: { message: "the daemon needs a token" } });
};
let pendingPrompt = null;

export function setTokenPrompt(prompt) {
  askForToken = prompt;
}

function promptOnce(reason) {
  if (!pendingPrompt) {
    pendingPrompt = askForToken(reason).finally(() => {
      pendingPrompt = null;
    });
  }
  return pendingPrompt;
}

function withAuth(headers, value) {
  const out = new Headers(headers || {});
  if (value) out.set("Authorization", "Bearer " + value);
  return out;
}

// fetch() with the stored token; a 401 asks for a token and tries again.
export async function authFetch(path, options = {}) {
  for (;;) {
    const sent = token.get();
    const response = await fetch(path, { ...options, headers: withAuth(options.headers, sent) });
    if (response.status !== 401) return response;
    if (token.get() !== sent) continue; // another request already got a new token
    await promptOnce(sent ? "refused" : "needed");
  }
}

// Checks a token the user typed without storing it: true when the daemon accepts it.
export async function tokenAccepted(candidate) {
  const response = await fetch("/v1/jobs?limit=1", { headers: withAuth({}, candidate) });
  if (response.status === 401) return false;
  if (!response.ok) throw await errorOf(response);
  return true;
}

async function errorOf(response) {
  let body = null;
  try {
    body = await response.json();
  } catch {
    body = null;
  }
  return new ApiError(response.status, body);
}

// JSON in, JSON out; a non-2xx answer throws ApiError with the envelope's message.
export async function api(path, { method = "GET", json, body, headers } = {}) {
  const options = { method, headers: new Headers(headers || {}) };
  if (json !== undefined) {
    options.body = JSON.stringify(json);
    options.headers.set("Content-Type", "application/json");
  } else if (body !== undefined) {
    options.body = body;
  }
  const response = await authFetch(path, options);
  if (!response.ok) throw await errorOf(response);
  const type = response.headers.get("content-type") || "";
  return type.includes("application/json") ? response.json() : response;
}

const sleep = (ms, signal) =>
  new Promise((resolve) => {
    const timer = setTimeout(resolve, ms);
    signal.addEventListener("abort", () => {
      clearTimeout(timer);
      resolve();
    });
  });

// Splits a text/event-stream into events (the WHATWG parsing rules, without the BOM case).
// Chunks may be cut anywhere, a CRLF included.
export class SseParser {
  constructor(onEvent, onRetry) {
    this.onEvent = onEvent;
    this.onRetry = onRetry;
    this.buffer = "";
    this.reset();
  }

  reset() {
    this.id = null;
    this.type = "";
    this.data = [];
  }

  feed(text) {
    this.buffer += text;
    // A CR at the very end may be the first half of a CRLF cut by the network: it waits.
    const lines = this.buffer.split(/\r\n|\r(?!$)|\n/);
    this.buffer = lines.pop(); // an incomplete last line waits for more bytes
    for (const line of lines) this.line(line);
  }

  line(line) {
    if (line === "") {
      if (this.data.length) {
        this.onEvent({ id: this.id, type: this.type || "message", data: this.data.join("\n") });
      }
      this.reset();
      return;
    }
    if (line.startsWith(":")) return; // a comment: the daemon's keep-alive ping
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "data") this.data.push(value);
    else if (field === "event") this.type = value;
    else if (field === "id") this.id = value;
    else if (field === "retry" && /^\d+$/.test(value)) this.onRetry(Number(value));
  }
}

// A job's events as server-sent events over fetch() (EventSource cannot send the
// Authorization header). After a dropped connection or a daemon restart it reconnects
// with Last-Event-ID, so no event is missed or seen twice. Ends at the `done` event.
export class JobEventStream {
  constructor(jobId, { onEvent, onDone, onState }) {
    this.jobId = jobId;
    this.onEvent = onEvent;
    this.onDone = onDone || (() => {});
    this.onState = onState || (() => {});
    this.lastId = 0;
    this.retryMs = 3000;
    this.abort = new AbortController();
    // The daemon pings every RP_SSE_PING_S (15 s by default): silence this long means a
    // half-open connection, which only a new request can tell.
    this.silenceMs = 45000;
    this.reconnects = 0;
  }

  start() {
    this.run();
    return this;
  }

  close() {
    this.abort.abort();
  }

  async run() {
    const signal = this.abort.signal;
    while (!signal.aborted) {
      let finished = false;
      try {
        finished = await this.once(signal);
      } catch (error) {
        if (signal.aborted) return;
        if (error instanceof ApiError && error.status === 404) {
          this.onState("gone", error.message);
          return;
        }
      }
      if (finished || signal.aborted) return;
      this.reconnects += 1;
      this.onState("reconnecting");
      await sleep(this.retryMs, signal);
    }
  }

  // One connection; true when the stream ended with its `done` event.
  async once(signal) {
    const request = new AbortController();
    const stopRequest = () => request.abort();
    signal.addEventListener("abort", stopRequest);
    const headers = { Accept: "text/event-stream" };
    if (this.lastId > 0) headers["Last-Event-ID"] = String(this.lastId);
    let done = false;
    let watchdog = null;
    const arm = () => {
      clearTimeout(watchdog);
      watchdog = setTimeout(stopRequest, this.silenceMs);
    };
    try {
      arm();
      const response = await authFetch(`/v1/jobs/${encodeURIComponent(this.jobId)}/events`, {
        headers,
        signal: request.signal,
        cache: "no-store",
      });
      if (!response.ok) throw await errorOf(response);
      this.onState("live");
      const parser = new SseParser(
        (event) => {
          if (event.type === "done") {
            done = true;
            this.onDone(JSON.parse(event.data));
            return;
          }
          const id = Number(event.id);
          if (!(id > this.lastId)) return; // never twice, whatever the server sends
          this.lastId = id;
          this.onEvent(JSON.parse(event.data));
        },
        (ms) => {
          this.retryMs = ms;
        },
      );
      const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
      for (;;) {
        const { value, done: ended } = await reader.read();
        if (ended) break;
        arm();
        parser.feed(value);
        if (done) break;
      }
      if (done) reader.cancel().catch(() => {});
      return done;
    } finally {
      clearTimeout(watchdog);
      signal.removeEventListener("abort", stopRequest);
    }
  }
}

// Saves a response body as a file (a checkpoint's tar). With a token it goes through a
// blob URL: a plain link could not carry the Authorization header.
// Without a token the browser streams the download itself (no copy of it in memory).
export async function download(path, filename) {
  let url = path;
  if (token.get()) {
    const response = await authFetch(path);
    if (!response.ok) throw await errorOf(response);
    url = URL.createObjectURL(await response.blob());
    setTimeout(() => URL.revokeObjectURL(url), 60000);
  }
  const link = document.createElement("a");
  link.href = url;
  link.download = filename;
  document.body.append(link);
  link.click();
  link.remove();
}
