"""Models and tokenizers loaded from Hugging Face folders (offline), and the embedded default model.

``loader`` loads a model and its tokenizer for the engines, the verifier and the trainer; ``families``
reads which decoder family a ``config.json`` is (the ones the torch runner implements); ``ops`` holds the
elementwise pieces the inference runner and the trainer's network share; ``tokenizer`` the tokenizer
helpers; ``gguf`` turns a llama.cpp file into a model folder, with ``gguf_tokenizer`` building its
tokenizer files from the file's metadata (and the metadata from a folder's files, for export);
``export`` writes a policy's weights as a Hugging Face folder and ``gguf_export`` a folder as a GGUF file.
May import: ``errors``, ``fsutil``, ``protocol``. Used by ``inference/`` and ``trainer/``."""
