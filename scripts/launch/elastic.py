"""Start one node's agent of an elastic ``scaletrain train`` job: torchrun with ``--nnodes=MIN:MAX`` and the
c10d rendezvous, set up as docs/tuning.md ("Autoscaling") describes. Run the same command on every node; nodes
may join later (up to MAX) or leave (down to MIN): torchrun restarts the workers, which resume from the latest
checkpoint at the new world size with the same global batch.

    python scripts/launch/elastic.py --nnodes 1:4 --endpoint HOST:29400 --id job1 -- \\
        --config configs/shakespeare_char_baby_adamw.toml --train.run_dir /shared/runs/elastic

``--dry-run`` prints the torchrun command instead of running it. A malformed ``--nnodes`` (MIN > MAX, not
numbers, MIN < 1) is one line on stderr and exit 2, before anything starts (torchrun itself answers it with a
traceback). This script only checks and assembles arguments: the engine is torchrun's elastic agent.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys


def parse_nnodes(text: str) -> tuple[int, int]:
    """'MIN:MAX' (or 'N' = N:N) -> (MIN, MAX); ValueError with the one-line reason otherwise."""
    m = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", text)
    if not m:
        raise ValueError(f"--nnodes {text!r}: write MIN:MAX (e.g. 1:4) or N")
    low, high = int(m.group(1)), int(m.group(2) or m.group(1))
    if low < 1:
        raise ValueError(f"--nnodes {text}: MIN must be >= 1")
    if low > high:
        raise ValueError(f"--nnodes {text}: MIN ({low}) is greater than MAX ({high}); write MIN:MAX with MIN <= MAX")
    return low, high


def torchrun_command(args: argparse.Namespace, train_args: list[str]) -> list[str]:
    low, high = parse_nnodes(args.nnodes)
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={low}:{high}",
            f"--nproc-per-node={args.nproc_per_node}", "--rdzv-backend=c10d", f"--rdzv-endpoint={args.endpoint}",
            f"--rdzv-id={args.id}", f"--max-restarts={args.max_restarts}",
            # Close a rendezvous round soon after MIN nodes are in, instead of torchrun's 30 s default wait.
            f"--rdzv-conf=last_call_timeout={args.last_call_seconds}",
            "-m", "scaletrain.cli", "train", *train_args, "--resume"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nnodes", required=True, help="MIN:MAX nodes (or N)")
    parser.add_argument("--endpoint", required=True, help="HOST:PORT of the c10d rendezvous (any node's address)")
    parser.add_argument("--id", default="scaletrain", help="rendezvous id: the same on every node of one job")
    parser.add_argument("--nproc-per-node", type=int, default=1)
    parser.add_argument("--max-restarts", type=int, default=10,
                        help="membership changes and failures torchrun absorbs before giving up")
    parser.add_argument("--last-call-seconds", type=int, default=2)
    parser.add_argument("--dry-run", action="store_true", help="print the torchrun command and exit")
    argv = sys.argv[1:] if argv is None else argv
    ours, train_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = parser.parse_args(ours)
    try:
        if args.nproc_per_node < 1 or args.max_restarts < 0:
            raise ValueError("--nproc-per-node must be >= 1 and --max-restarts >= 0")
        cmd = torchrun_command(args, train_args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    os.execv(cmd[0], cmd)  # torchrun takes this process's place (signals reach it directly)


if __name__ == "__main__":
    sys.exit(main())
