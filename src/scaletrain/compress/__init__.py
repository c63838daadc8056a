"""Compression of a trained model: pruning (unstructured, 2:4, structured) and post-training quantization,
as transforms over the pure model (docs/compression.md). ``compress/cli.py`` is `scaletrain compress`."""
