"""``scaletrain serve``: an OpenAI-compatible HTTP server (and a chat page at ``/``) over one run's ``Session``,
its requests batched continuously (``infer/batch.py``). A thin layer: the generation is the session's."""
