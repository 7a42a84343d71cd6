"""Run the smoke pipeline under two processes again and again, fresh and then resumed, and count the exits.

    python scripts/two_process_runs.py --runs 10 --root runs/two_process

Each run is `accelerate launch --multi_gpu --num_processes 2 train.py +exp=smoke train.deepspeed=zero2` under
a new name and a run root of its own (so every stage runs, the store's too), then the same command again (a
resume). A run passes when both exit 0 and each prints one summary.
Ends with `RESULT passed=<runs that passed> runs=<runs>`.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(root: Path, name: str, attempt: str) -> tuple[int, int, float]:
    """(exit code, summaries printed, seconds) of one two-process pipeline."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--main_process_port", str(free_port()), "train.py", "+exp=smoke",
           "train.deepspeed=zero2", f"run_root={root / name}", f"name={name}"]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    (root / f"{name}-{attempt}.log").write_text(proc.stdout + proc.stderr)
    return proc.returncode, proc.stdout.count(f"specdistill run `{name}` done"), time.time() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--root", type=Path, default=Path("runs/two_process"))
    args = parser.parse_args()
    args.root.mkdir(parents=True, exist_ok=True)
    passed = 0
    print("| run | fresh: exit, summaries, s | resumed: exit, summaries, s |\n|---|---|---|")
    for i in range(args.runs):
        name = f"run{i}-{int(time.time())}"
        fresh, resumed = launch(args.root, name, "fresh"), launch(args.root, name, "resumed")
        passed += all(code == 0 and count == 1 for code, count, _ in (fresh, resumed))
        print(f"| {name} | {fresh[0]}, {fresh[1]}, {fresh[2]:.0f} | {resumed[0]}, {resumed[1]}, {resumed[2]:.0f} |",
              flush=True)
    print(f"logs: {args.root}/<run>-fresh.log and <run>-resumed.log, runs: {args.root}/<run>/")
    print(f"RESULT passed={passed} runs={args.runs}")


if __name__ == "__main__":
    main()
