"""Code the tests share, kept out of the ``test_*.py`` files: tiny configs (``tiny``), process launchers
(``launch``), fault injection (``faults``), waits that survive a slow machine (``waits``), benchmark scripts as modules
(``scripts``), how pytest-xdist hands the tests out (``schedule``), and the scripts torchrun starts (``dist_parity``,
``dist_train``, ``fault_train``, ``slow_rank_train``, ``deepspeed_parity``). A test imports from here, never from
another test."""
