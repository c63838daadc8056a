"""The DeepSpeed engine (``parallel.engine = "deepspeed"``, extra ``scaletrain[deepspeed]``), in one place:

- ``ds_config.py``: what does not depend on the trainer: the rules a DeepSpeed job must pass (asked by
  ``train/validate.py``), the ``ds_config`` built from our config and merged with a user's ``ds_config.json``,
  and ``deepspeed.initialize``;
- ``engine.py``: the ``TrainingEngine`` the trainer holds (build, step, DeepSpeed's own checkpoints, their
  conversion to a universal checkpoint to resume at another world size).

Reading a DeepSpeed checkpoint back as one plain model stays in ``checkpoint/deepspeed_format.py``: every reader
of a run (eval, generate, export, finetune.source, compress) loads through ``checkpoint/run.py``, below train and
finetune, and the trainer's resume check (``checkpoint/training.py``) asks it too.
"""
