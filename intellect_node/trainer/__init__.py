"""The trainable network, the GRPO loss, the step, the online filter, the optimizer and checkpoints.

``lean`` is the trainer's own causal LM (the supported families as plain ``torch.nn``); ``model`` loads it
with its options; ``grpo`` the GRPO objective with the INTELLECT-2 changes, ``losses`` its per-token
variants (``rl.loss``), ``stepsize`` the lr schedule (warmup, target-KL step); ``step`` one training step;
``distributed`` the same step under torch.distributed (DDP or FSDP2, ``torchrun``); ``filtering`` the
online filter; ``optim`` the optimizer; ``checkpoint`` checkpoints; ``optstate`` the optimizer state as a
content-addressed file. Imports ``models/`` and ``policy/`` below it; no networking. Tasks and rewards are
``envs/``'s."""
