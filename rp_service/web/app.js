// The dashboard's entry: hash routes to pages, the token dialog, the version line.

import { api, setTokenPrompt, token, tokenAccepted } from "./api.js";
import { el } from "./format.js";
import { renderApi } from "./pages/api.js";
import { renderJob } from "./pages/job.js";
import { renderJobs } from "./pages/jobs.js";
import { renderNewJob } from "./pages/new.js";
import { renderSystem } from "./pages/system.js";

const ROUTES = [
  [/^#\/jobs\/([^/]+)$/, "jobs", (view, m) => renderJob(view, decodeURIComponent(m[1]))],
  [/^#\/new$/, "new", (view) => renderNewJob(view)],
  [/^#\/system$/, "system", (view) => renderSystem(view)],
  [/^#\/api$/, "api", (view) => renderApi(view)],
  [/^(#\/jobs)?$/, "jobs", (view) => renderJobs(view)],
];

let cleanup = null;

function route() {
  if (cleanup) cleanup();
  cleanup = null;
  const view = document.getElementById("view");
  view.replaceChildren();
  const path = location.hash.split("?")[0]; // #/jobs?status=running filters the list
  const hash = path === "#/" ? "" : path;
  const found = ROUTES.find(([pattern]) => pattern.test(hash));
  if (!found) {
    view.append(el("p", { class: "error" }, `No page ${hash}: try `, el("a", { href: "#/jobs" }, "Jobs")));
    return;
  }
  const [pattern, nav, render] = found;
  for (const link of document.querySelectorAll("[data-nav]")) {
    link.classList.toggle("active", link.dataset.nav === nav);
  }
  cleanup = render(view, hash.match(pattern)) || null;
}

// The dialog shown on a 401: resolves once the daemon accepts the typed token.
function promptForToken(reason) {
  const dialog = document.getElementById("token-dialog");
  const form = document.getElementById("token-form");
  const input = document.getElementById("token-input");
  const error = document.getElementById("token-error");
  document.getElementById("token-reason").textContent =
    reason === "refused"
      ? "The daemon no longer accepts the stored token; type its current RP_TOKEN."
      : "This daemon needs its bearer token (RP_TOKEN).";
  error.textContent = "";
  input.value = "";
  return new Promise((resolve) => {
    const submit = async (event) => {
      event.preventDefault();
      const candidate = input.value.trim();
      if (!candidate) return;
      try {
        if (await tokenAccepted(candidate)) {
          token.set(candidate);
          form.removeEventListener("submit", submit);
          dialog.close();
          resolve();
        } else {
          error.textContent = "The daemon refused this token (401). Check RP_TOKEN and try again.";
          input.select();
        }
      } catch (failure) {
        error.textContent = `Could not check the token: ${failure.message}`;
      }
    };
    form.addEventListener("submit", submit);
    // Escape would leave the page with no way to get data: keep the dialog open.
    dialog.addEventListener("cancel", (event) => event.preventDefault());
    if (!dialog.open) dialog.showModal();
    input.focus();
  });
}

async function showVersion() {
  try {
    const system = await api("/v1/system");
    document.getElementById("version").textContent = `rp_service ${system.version}`;
  } catch {
    // the System page reports errors; the header line stays empty
  }
}

setTokenPrompt(promptForToken);
window.addEventListener("hashchange", route);
route();
showVersion();
