"""Commands that choose settings by running the trainer: ``scaletrain tune`` (an Optuna study over config
fields, study.py / space.py) and ``scaletrain lr-find`` (the learning-rate range test, lr_find.py)."""
