"""Training objectives of a job (`train.objective`): what a step's loss is and what it needs,
each behind the `base.Objective` protocol the training loop sees.

sft   the causal-LM loss on the trained tokens (`sft`)
dpo   Direct Preference Optimization on (prompt, chosen, rejected) pairs (`dpo`, `dpo_job`)
grpo  Group Relative Policy Optimization on prompts and a grader's rewards (`grpo`,
      `grpo_job`; docs/RL.md)
"""
