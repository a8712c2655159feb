"""tau2_rl: multi-turn GRPO for tool-calling agents on the tau2-bench airline domain, built on TRL."""
