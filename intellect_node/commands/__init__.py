"""Command groups of the CLI; each module exposes ``register(app)`` (see ``intellect_node/cli.py``).

- running a node: ``join`` (run one until SIGINT/SIGTERM), ``demo`` (a whole swarm on this machine),
  ``status``, ``stop``, ``logs``, ``service`` (a systemd unit);
- runs: ``run`` (``run init``, ``run publish``, ``run report`` drawn by ``report``), ``runs`` (finding
  runs, and what ``join --run`` does first), ``tasks`` (the run's problems and the offline filter),
  ``sweep`` (research sweeps);
- the node's own things: ``keys`` (its identity), ``peers`` (its bans), ``ledger`` (receipts of its work),
  ``blob`` and ``blob_store`` (publishing, fetching and the store's disk), ``config`` (``config show``);
- models and checks: ``model`` (the embedded model, GGUF import; ``model export`` in ``export``: a
  run's policy as a Hugging Face folder and GGUF), ``rollout`` (signed rollouts and their
  verification), ``proofs`` (threshold calibration), ``audit`` (``audit calibrate``);
- ``doctor``: what commonly goes wrong, with ``checks`` (one result per thing looked at) and
  ``doctor_model`` (will this machine hold the model);
- shared pieces: ``common`` (options and helpers), ``progress`` (progress of long work on a terminal or
  as JSON lines)."""
