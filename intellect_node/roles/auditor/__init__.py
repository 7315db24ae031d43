"""The auditor: training steps replayed from the trainer's signed step records.

``replay`` takes a window of steps again; ``inputs`` holds what a replay needs besides the records (the
run's step settings, each batch re-scored into groups); ``windows`` chooses which steps an auditor replays
and where each window starts; ``chain`` is the chain auditor that fetches start states and runs windows;
``evidence`` checks a record without replaying it (admission evidence, accepted work dropped);
``drops`` checks the reasons a record gives for the accepted batches it dropped (``not_assigned``,
``wrong_task``, ``duplicate``) on the batches themselves;
``published`` fetches the weights and optimizer state the trainer published for a step, and ``tolerance``
compares a replay with them where bitwise replay does not hold; ``calibration`` calibrates
``run.audit_tolerance`` on the run's own model and task."""
