"""``python -m scaletrain`` and the ``scaletrain`` console command: the memory allocator first (allocator.py:
the process may re-execute itself once with jemalloc preloaded, before torch is imported), then the CLI."""

import sys


def entry() -> int:
    from scaletrain.hardware.allocator import AllocatorError, preload

    try:
        preload(sys.argv[1:])
    except AllocatorError as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    from scaletrain.cli import main

    return main()


if __name__ == "__main__":
    sys.exit(entry())
