"""The validator role (``role.py``) and its intake (``intake.py``)."""
