"""Data: sources -> clean -> filter -> dedup -> tokenize -> shards -> loader. One stage a module."""
