// Samples panel of a job's page: the greedy completions of train.sample_prompts that the
// worker writes at each evaluation (`sample` events, docs/CHAT.md), newest step first.
// A GRPO job's rollouts carry `reward` and `rewards` (grader name -> score, docs/RL.md):
// the table then grows a Reward column and a per-grader one.
//
// One table body per step: a step trained again after a resume samples again, and its
// newer completions replace the older ones. Prompts and completions are user text and
// go in as text nodes (format.js's el), never as HTML.

import { el, integer, number } from "../format.js";

const MAX_STEPS = 100; // the newest steps kept on the page

export function samplesPanel() {
  const empty = el("p", { id: "samples-empty", class: "muted" }, "No samples yet: they come at each evaluation.");
  const headRow = el("tr", {}, ["Step", "Prompt", "Completion"].map((h) => el("th", {}, h)));
  const table = el("table", { id: "samples-table", class: "samples" }, el("thead", {}, headRow));
  let rewarded = false; // whether the Reward columns are in the header
  const node = el("section", { id: "samples", hidden: true }, el("h2", {}, "Samples"), empty, table);
  const bodies = new Map(); // step -> its tbody

  // The panel shows once the spec asks for samples, or a sample event arrives.
  function show(spec) {
    if (spec?.train?.sample_prompts?.length) node.hidden = false;
  }

  // "name: score" per grader, as text.
  function byGrader(rewards) {
    if (!rewards || typeof rewards !== "object") return "";
    return Object.entries(rewards)
      .map(([name, value]) => `${name}: ${typeof value === "number" ? number(value, 3) : "–"}`)
      .join(", ");
  }

  function rewardCells(s) {
    if (!rewarded) return [];
    return [
      el("td", { class: "num sample-reward" }, typeof s.reward === "number" ? number(s.reward, 3) : "–"),
      el("td", { class: "sample-rewards" }, byGrader(s.rewards)),
    ];
  }

  function body(step, data) {
    const samples = data.samples.filter((s) => s && typeof s === "object");
    if (!rewarded && samples.some((s) => typeof s.reward === "number")) {
      rewarded = true;
      headRow.append(el("th", {}, "Reward"), el("th", {}, "By grader"));
    }
    const rows = samples.map((s, i) =>
      el(
        "tr",
        { dataset: { index: i } },
        i === 0
          ? el("td", { class: "num sample-step", rowspan: samples.length }, integer(step))
          : null,
        el("td", { class: "sample-prompt" }, String(s.prompt ?? "")),
        el(
          "td",
          { class: "sample-completion", title: `${s.tokens ?? "?"} tokens, ${s.finish_reason ?? ""}` },
          String(s.completion ?? ""),
        ),
        ...rewardCells(s),
      ),
    );
    return el("tbody", { dataset: { step, attempt: data.attempt ?? "" } }, rows);
  }

  function add(event) {
    const data = event.data || {};
    if (typeof data.step !== "number" || !Array.isArray(data.samples)) return;
    node.hidden = false;
    empty.remove();
    const next = body(data.step, data);
    const old = bodies.get(data.step);
    if (old) {
      old.replaceWith(next);
    } else {
      // newest step first: before the first body of an older step
      const older = [...bodies.keys()].filter((s) => s < data.step).sort((a, b) => b - a)[0];
      if (older === undefined) table.append(next);
      else bodies.get(older).before(next);
    }
    bodies.set(data.step, next);
    while (bodies.size > MAX_STEPS) {
      const oldest = Math.min(...bodies.keys());
      bodies.get(oldest).remove();
      bodies.delete(oldest);
    }
  }

  return { node, show, add };
}
