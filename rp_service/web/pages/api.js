// API: every route of the daemon, read from its OpenAPI schema (GET /openapi.json) with the
// page's token. /docs redirects here: no Swagger UI from a CDN, so it works offline.

import { api } from "../api.js";
import { describeError, el } from "../format.js";

const METHODS = ["get", "post", "put", "patch", "delete"];

export function renderApi(view) {
  const error = el("p", { class: "error", role: "alert" });
  const body = el("tbody");
  view.append(
    el("h1", {}, "API"),
    el(
      "p",
      { class: "muted" },
      "Every route, from ",
      el("a", { href: "/openapi.json" }, "/openapi.json"),
      " (bearer token). Objects, errors and the JobSpec: docs/API.md.",
    ),
    error,
    el(
      "table",
      { id: "api-routes" },
      el("thead", {}, el("tr", {}, ["Method", "Path", "What"].map((h) => el("th", {}, h)))),
      body,
    ),
  );
  (async () => {
    try {
      const schema = await api("/openapi.json");
      for (const [path, item] of Object.entries(schema.paths)) {
        for (const method of METHODS.filter((m) => item[m])) {
          const op = item[method];
          body.append(
            el(
              "tr",
              {},
              el("td", {}, el("code", {}, method.toUpperCase())),
              el("td", {}, el("code", {}, path)),
              el("td", {}, op.summary || ""),
            ),
          );
        }
      }
    } catch (failure) {
      error.textContent = describeError(failure, "Reading /openapi.json");
    }
  })();
}
