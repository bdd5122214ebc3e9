"""Find the keys a set-based step fails for, and do it for all the others.

A batch's step (one statement, or a pass's few statements) runs for all its keys
at once; where it fails, the failing keys are searched for in groups, each failing
group halved down to its first failing key, so a poisoned key costs a few more
statements, never its neighbours' outcomes. The runner isolates a pass's whole work this way
(``tasks.runner``); ``store.transitions.expire_many`` isolates its one statement,
so that a poisoned row does not also repeat its neighbours' audit events and
children's retirement in every part.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

K = TypeVar("K")
R = TypeVar("R")

# Once the whole batch failed, it is tried again in groups of a GROUPS-th of it (a group
# that succeeds is done). Each failing group is halved down to its first failing key, and
# what the halving did not try goes back to be grouped again: generalized binary
# splitting, about log2(group) statements per poisoned key. A failing group halves the
# next group's size, a clean one doubles it back: a run of poisoned keys is tried key by
# key. On a batch of 1,000 (statements, against splitting every failed part 16 ways):
# one poisoned key in a hundred 101 (214), ten together 47 (45), 500 together 529 (646).
GROUPS = 16


def isolate(
    keys: Sequence[K],
    attempt: Callable[[Sequence[K]], R],
    *,
    goes_up: Callable[[BaseException], bool],
) -> tuple[list[R], list[tuple[K, Exception]]]:
    """``attempt`` on all ``keys``, else in parts down to the failing keys: (results, failures).

    ``attempt`` must leave nothing behind when it raises (run it under a savepoint).
    An error for which ``goes_up`` is true (transient trouble, an abort) ends the
    whole search and is raised, as is anything that is not an ``Exception``; any
    other error, once its part is one key, is that key's own. Keys are done in
    their order, each healthy one in exactly one successful attempt.
    """
    results: list[R] = []
    failed: list[tuple[K, Exception]] = []

    def refusal(part: Sequence[K]) -> Exception | None:
        """None if ``attempt`` took ``part``, else the error it refused it with."""
        try:
            results.append(attempt(part))
        except Exception as err:
            if goes_up(err):
                raise
            return err
        return None

    if not keys or (err := refusal(keys)) is None:
        return results, failed
    if len(keys) == 1:
        return results, [(keys[0], err)]
    widest = size = -(-len(keys) // GROUPS)
    rest = list(keys)
    while rest:
        group, rest = rest[:size], rest[size:]
        if (err := refusal(group)) is None:
            size = min(widest, 2 * size)  # failures are sparse here: wider groups again
            continue
        size = max(1, size // 2)  # dense: narrower groups, down to key by key in a poisoned run
        while len(group) > 1:  # ``group`` fails (``err`` is None where that is only deduced)
            half = len(group) // 2
            if (first := refusal(group[:half])) is None:
                group, err = group[half:], None  # the failing key is in the other half
            else:
                rest = [*group[half:], *rest]  # untried: grouped again
                group, err = group[:half], first
        if err is None:  # deduced: tried alone, for its own error (or it goes through alone)
            err = refusal(group)
        if err is not None:
            failed.append((group[0], err))
    return results, failed
