"""Reward environments: where a run's problems come from and how a completion is scored.

``extract`` cuts the answer out of a completion (answer tags, ``\boxed{}``, the last line, ``<think>``
handling, a length limit); ``mathcheck`` is the ``math`` checker (math-verify); ``reasoning_gym`` builds
problems from reasoning-gym datasets by ID; ``environment`` turns the ``[rl]`` settings into the run's
task; ``sandbox`` runs checkers in child processes under a time limit (``_child`` is the child's side).
docs/environments.md is the operator's guide.

``tasks`` holds the problem and task types every role uses, the embedded task and the task registry;
``jsonl_tasks`` reads task files; ``filtering`` is the offline solve-rate filter; ``assignment`` says
which problems a worker works on (a pure function every node recomputes, never the worker's choice);
``heldout`` holds the run's evaluation problems out of training (``run.eval_every``).
Below ``trainer/`` and ``inference/``: imports only ``errors`` and ``fsutil`` (no networking, no torch).
Kept light to import: the scoring child process imports this package first."""
