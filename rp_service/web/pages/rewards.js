// A GRPO job's charts, beside the loss: the mean reward and its spread, each grader's mean
// reward, the KL to the reference, the clip fraction, the completion length and the
// grader errors (the names of docs/RL.md's metrics). They appear when a metrics event
// first carries `reward_mean`, so a job of any other objective never shows them.

import { LineChart, Series } from "../chart.js";
import { el, integer, number } from "../format.js";

const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04"];
const GRADER_PREFIX = "grader/"; // a grader's series key in its chart: grader/<name>

// [canvas id, title, [metric key, legend label]...]; the graders' chart fills in as they come.
const CHARTS = [
  [
    "chart-reward",
    "reward",
    [
      ["reward_mean", "mean"],
      ["reward_std", "std"],
    ],
  ],
  ["chart-grader-rewards", "reward per grader", []],
  ["chart-kl", "KL to the reference", [["kl", "kl"]]],
  ["chart-clip", "clip fraction", [["clip_fraction", "clipped"]]],
  ["chart-completion", "completion tokens (mean)", [["completion_tokens_mean", "tokens"]]],
  ["chart-grader-errors", "grader errors", [["grader_errors", "errors"]]],
];

// The summary rows of a GRPO job's latest metrics; none for other jobs. (The daemon keeps
// the scalar metrics on the job; each grader's mean stays in the events: see its chart.)
export function rewardSummary(metrics) {
  if (typeof metrics.reward_mean !== "number") return [];
  return [
    ["reward mean", number(metrics.reward_mean, 3)],
    ["reward std", number(metrics.reward_std, 3)],
    ["grader errors", integer(metrics.grader_errors)],
  ];
}

// Charts placed after `anchor` (the loss chart's canvas) once the job turns out to be GRPO.
export function rewardCharts(anchor) {
  let charts = null;

  function create() {
    charts = new Map(
      CHARTS.map(([id, title, columns]) => {
        const canvas = el("canvas", { id, class: "chart" });
        const chart = new LineChart(canvas, {
          title,
          format: (v) => number(v, 3),
          series: columns.map(([key, label], i) => new Series(key, label, COLORS[i])),
          empty: id === "chart-kl" ? "no KL term (kl_coef is 0)" : "no data yet",
        });
        return [id, chart];
      }),
    );
    anchor.after(...[...charts.values()].map((chart) => chart.canvas));
  }

  function pushGraders(rewards, step) {
    if (!rewards || typeof rewards !== "object") return;
    const chart = charts.get("chart-grader-rewards");
    for (const [name, value] of Object.entries(rewards)) {
      if (typeof value !== "number") continue;
      const key = GRADER_PREFIX + name;
      chart.ensure(key, () => new Series(key, name, COLORS[chart.series.size % COLORS.length]));
      chart.push(key, step, value);
    }
  }

  return {
    onMetrics(data, step) {
      if (!charts && typeof data.reward_mean !== "number") return;
      if (!charts) create();
      for (const [id, chart] of charts) {
        if (id === "chart-grader-rewards") continue;
        for (const key of chart.series.keys()) {
          if (typeof data[key] === "number") chart.push(key, step, data[key]);
        }
      }
      pushGraders(data.rewards, step);
    },
  };
}
