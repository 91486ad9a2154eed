"""Adapters between blocktrie and model libraries (each behind its own optional extra).

- `cache.integrations.transformers` (the ``hf`` extra): serve Hugging Face
  ``transformers`` hybrid attention + SSM models through a `cache.BlockTrie`.

The core (`cache`) never imports anything from here.
"""
