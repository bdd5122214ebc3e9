"""Find the keys a set-based step fails for, and do it for all the others.

A batch's step (one statement, or a pass's few statements) runs for all its keys
at once; where it fails, it runs again on ``SPLIT`` parts, recursively, until
every failing key stands alone. So a poisoned key costs a few more statements,
never its neighbours' outcomes. The runner isolates a pass's whole work this way
(``tasks.runner``); ``store.transitions.expire_many`` isolates its one statement,
so that a poisoned row does not also repeat its neighbours' audit events and
children's retirement in every part.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

K = TypeVar("K")
R = TypeVar("R")

# A failed step is retried as this many parts, recursively. On a batch of 1,000 with 1%
# poisoned rows, clustered or one in a hundred, 4 to 16 parts cost about the same and
# halves cost more (bench/storm.py, the poison lines): every failed step is pure cost.
SPLIT = 16


def isolate(
    keys: Sequence[K],
    attempt: Callable[[Sequence[K]], R],
    *,
    goes_up: Callable[[BaseException], bool],
) -> tuple[list[R], list[tuple[K, Exception]]]:
    """``attempt`` on all ``keys``, else on parts down to the failing keys: (results, failures).

    ``attempt`` must leave nothing behind when it raises (run it under a savepoint).
    An error for which ``goes_up`` is true (transient trouble, an abort) ends the
    whole search and is raised, as is anything that is not an ``Exception``; any
    other error, once its part is one key, is that key's own.
    """
    results: list[R] = []
    failed: list[tuple[K, Exception]] = []

    def run(part: Sequence[K]) -> None:
        try:
            results.append(attempt(part))
        except Exception as err:
            if goes_up(err):
                raise
            if len(part) == 1:
                failed.append((part[0], err))
                return
            size = -(-len(part) // SPLIT)
            for start in range(0, len(part), size):
                run(part[start : start + size])

    if keys:
        run(keys)
    return results, failed
