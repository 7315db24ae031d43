"""Models and tokenizers loaded from Hugging Face folders (offline), and the embedded default model.
May import: ``errors``, ``fsutil``, ``protocol``. Used by ``inference/`` and ``trainer/``.
"""
