"""Training objectives of a job (`train.objective`): what a step's loss is and what it needs.

sft  the causal-LM loss on the trained tokens (the path `training` runs itself)
dpo  Direct Preference Optimization on (prompt, chosen, rejected) pairs
"""
