"""The auditor: training steps replayed from the trainer's signed step records (``replay.py``)."""
