"""The trainer role (``role.py``) and its parts.

- intake: ``prefetch`` fetches and decodes a batch while its validators verify it, ``intake`` takes it
  from the worker's notice to the training queue (and says who is blamed), with ``roles/common/rescore``
  checking an accepted batch once more and turning it into groups with the trainer's own rewards;
- admission: ``admission`` (the pure state machine of admitted work and each step's batches) with its
  pieces in ``batching``; ``admitted`` and ``inbox`` keep admitted work through a SIGKILL;
- out: ``records`` signs a step record per journaled step, ``publication`` publishes each new version in
  order, ``metrics`` writes ``trainer/metrics.jsonl`` and ``mirrors`` copies its lines (and held-out
  results) to W&B and TensorBoard, ``nosignal`` says so when a step had nothing to learn from,
  ``stepcheck`` when a step moved the policy too far (KL, tokens cut);
- ``replay``: the steps journaled since the last checkpoint, taken again after a restart."""
