"""The trainable network, the GRPO loss, the step, the online filter, the optimizer and checkpoints.
Imports ``models/`` and ``policy/`` below it; no networking. Tasks and rewards are ``envs/``'s."""
