// A DPO job's charts, beside the loss: TRL's rewards (chosen, rejected, margin), the reward
// accuracy and the policy's log-probabilities. They appear when a metrics event first
// carries `rewards/margins`, so a job of any other objective never shows them.

import { LineChart, Series } from "../chart.js";
import { el, number } from "../format.js";

const CHOSEN = "#16a34a";
const REJECTED = "#dc2626";
const MARGIN = "#2563eb";

// [canvas id, title, [metric key, legend label, color]...]
const CHARTS = [
  [
    "chart-rewards",
    "rewards (β · log π/π_ref)",
    [
      ["rewards/chosen", "chosen", CHOSEN],
      ["rewards/rejected", "rejected", REJECTED],
      ["rewards/margins", "margin", MARGIN],
    ],
  ],
  ["chart-accuracy", "reward accuracy", [["rewards/accuracies", "accuracy", MARGIN]]],
  [
    "chart-logps",
    "log-probabilities",
    [
      ["logps/chosen", "chosen", CHOSEN],
      ["logps/rejected", "rejected", REJECTED],
    ],
  ],
];

// The summary rows of a DPO job's latest metrics; none for other jobs.
export function preferenceSummary(metrics) {
  if (typeof metrics["rewards/margins"] !== "number") return [];
  return [
    ["reward accuracy", number(metrics["rewards/accuracies"], 3)],
    ["reward margin", number(metrics["rewards/margins"], 4)],
  ];
}

// Charts placed after `anchor` (the loss chart's canvas) once the job turns out to be DPO.
export function preferenceCharts(anchor) {
  let charts = null;

  function create() {
    charts = CHARTS.map(([id, title, columns]) => {
      const canvas = el("canvas", { id, class: "chart" });
      return [
        canvas,
        new LineChart(canvas, {
          title,
          format: (v) => number(v, 3),
          series: columns.map(([key, label, color]) => new Series(key, label, color)),
        }),
      ];
    });
    anchor.after(...charts.map(([canvas]) => canvas));
  }

  return {
    onMetrics(data, step) {
      if (!charts && typeof data["rewards/margins"] !== "number") return;
      if (!charts) create();
      for (const [, chart] of charts) {
        for (const key of chart.series.keys()) {
          if (typeof data[key] === "number") chart.push(key, step, data[key]);
        }
      }
    },
  };
}
