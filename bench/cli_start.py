"""How long `poolctl` takes to start: each common command against a bare ``python -c pass``.

Every command runs as the console script does (``from poolkeeper.cli import main; main()``),
in a fresh interpreter, on an initialised SQLite store and board in a temporary folder. The
runs are interleaved (one of each command per round, ``--rounds`` rounds) so a change of
load touches every command alike; each figure is the median of its rounds, and the ratio
to the baseline's median in the same run is what to compare (targets, issue 29: ``--version``
and ``--help`` within 4x, ``status`` and ``board add`` within 8x). The ``import ...`` lines
are the floors: the libraries under the commands, each imported alone. The CPU columns (the
child's user and system time) move less with the machine's load than the wall times do.

    python bench/cli_start.py [--rounds N]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

POOLCTL = [sys.executable, "-c", "from poolkeeper.cli import main; main()"]
BASELINE = "python -c pass"
COMMANDS: dict[str, list[str]] = {
    BASELINE: [sys.executable, "-c", "pass"],
    "--version": [*POOLCTL, "--version"],
    "--help": [*POOLCTL, "--help"],
    "status": [*POOLCTL, "status"],
    "board add": [*POOLCTL, "board", "add", "bench", "a task"],
    "board list": [*POOLCTL, "board", "list", "bench"],
    # refuses a malformed token before it connects anywhere
    "worker (bad token)": [*POOLCTL, "worker", "--ordinal", "0", "--command", "true", "--token", "x"],
}
# What the commands cannot start below: the libraries they stand on, each imported alone.
# typer._adapters (pydantic) is what typer loads to parse any command's arguments.
FLOORS = ("typer", "typer._adapters", "rich.table", "sqlalchemy", "sqlalchemy.orm", "redis")
COMMANDS.update({f"import {module}": [sys.executable, "-c", f"import {module}"] for module in FLOORS})


def _env(folder: Path) -> dict[str, str]:
    return {
        **os.environ,
        "POOL_DATABASE_URL": f"sqlite:///{folder / 'pool.db'}",
        "POOL_BOARD_URL": f"sqlite:///{folder / 'board.db'}",
        "POOL_REDIS_URL": "redis://127.0.0.1:1/0",  # nothing listens: status says so at once
        "POOL_WORKER_URL": "http://127.0.0.1:1",
        "COLUMNS": "100",
    }


def _seconds(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """The wall time and the CPU time (user and system) of one run of ``argv``."""
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def measure(rounds: int) -> dict[str, tuple[float, float]]:
    """Each command's median wall and CPU time in seconds over ``rounds`` interleaved rounds."""
    with tempfile.TemporaryDirectory() as tmp:
        env = _env(Path(tmp))
        subprocess.run([*POOLCTL, "init"], env=env, check=True, stdout=subprocess.DEVNULL)
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in COMMANDS}
        for _ in range(rounds):
            for name, argv in COMMANDS.items():
                times[name].append(_seconds(argv, env))
    return {name: (_median(runs, 0), _median(runs, 1)) for name, runs in times.items()}


def _median(runs: list[tuple[float, float]], i: int) -> float:
    return statistics.median(run[i] for run in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    medians = measure(args.rounds)
    wall, cpu = medians[BASELINE]
    print(f"{'command':<22} {'median ms':>10} {'x python -c pass':>17} {'cpu ms':>8} {'x (cpu)':>8}")
    for name, (w, c) in medians.items():
        print(f"{name:<22} {w * 1000:>10.1f} {w / wall:>16.1f}x {c * 1000:>8.1f} {c / cpu:>7.1f}x")
    print(f"(median of {args.rounds} interleaved rounds; load {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
