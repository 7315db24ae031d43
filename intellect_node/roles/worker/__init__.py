"""The worker role (``role.py``)."""
