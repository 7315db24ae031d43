"""The trainer role (``role.py``) and its parts."""
