"""What the trainer, worker and validator roles share: the seam to the node (``seams``), the run's task
(``tasks``), what a role needs of the run (``run``), the node services beside it (``services``), the run's
model (``models``), fetching blobs from known holders (``fetch``), records as training samples
(``records``), each rollout counted once (``seen``), policy distribution (``policy``) and following the
trainer's policy (``follow``), engine settings (``engines``), completion texts (``completions``) and which
blobs a node keeps (``pins``); what every node makes of the auditors' verdicts (``audits``), the one hash
per policy version every node checks (``binding``) and the trainer's signed step records kept in a node's
ledger (``receipts``); the signed run feed a report made from the swarm reads (``feed``); and what the
trainer and its auditors both compute: an accepted batch checked again and re-scored from the task
(``rescore``) and the GRPO settings of a run and of a step record (``grpo``).

Each role is a node service (``start``/``close``/``status``, see ``node/runtime.py``). Its loop runs as an
asyncio task; every torch call goes to a worker thread (``asyncio.to_thread``) so the event loop keeps
serving HTTP and gossip while a model runs.
"""
