"""Reward environments: where a run's problems come from and how a completion is scored.

``extract`` cuts the answer out of a completion (answer tags, ``\\boxed{}``, the last line, ``<think>``
handling, a length limit); ``mathcheck`` is the ``math`` checker (math-verify); ``reasoning_gym`` builds
problems from reasoning-gym datasets by ID; ``environment`` turns the ``[rl]`` settings into the run's
task; ``sandbox`` runs checkers in child processes under a time limit. docs/environments.md is the
operator's guide.

Same layer as ``trainer/`` (imports ``errors`` and ``envs.tasks``; no networking, no torch). Kept
light to import: the scoring child process imports this package first.
"""
