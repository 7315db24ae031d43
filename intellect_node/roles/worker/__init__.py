"""The worker role (``role.py``) and when it makes its next batch (``pacing.py``: never more than the
trainer will take, never idle while it waits)."""
