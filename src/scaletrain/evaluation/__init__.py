"""Benchmarks through EleutherAI's lm-evaluation-harness (the optional ``lm-eval`` package).

- ``model.py``: a loaded run as an lm-eval ``LM`` (loglikelihood, loglikelihood_rolling, generate_until), scored
  with the run's own tokenizer and model, with the rules of lm-eval's ``hf`` backend (left truncation, the
  BOS/EOS prefix, stop sequences), so that it gives the ``hf`` backend's numbers on the run's HF export.
- ``cloze.py``: the gutenberg-cloze task, built from the run's held-out (validation) text; needs no network.
- ``tasks.py``: ``scaletrain eval --tasks``: resolve the task names, run lm-eval's own ``simple_evaluate``, print
  each score beside its settings and write the JSON.

Nothing here is imported unless ``--tasks`` is given, so lm-eval stays optional.
"""
