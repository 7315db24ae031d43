"""Tasks, rewards, the GRPO loss, the optimizer step and checkpoints. No networking."""
