"""tau2_rl: multi-turn GRPO for tool-calling agents on τ²-bench's domains, built on TRL."""
