"""Using a trained model: ``scaletrain generate`` (batched, streamed) and ``scaletrain chat``, over the KV-cached
generation of ``model/generate.py``."""
