"""What a Python worker's callable is given for its grant: ``Context``, and the ``Child`` it registers.

The runner (``poolkeeper.workerhost.runner``) builds one ``Context`` per call from the grant's
payload and the environment the command worker gives a command (``worker.grant_env``), so
the callable and the commands it starts see the same grant. Children are registered and
reported with the grant's child token only (``POOL_CHILD_TOKEN``): never the ordinal's.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from poolkeeper.workerhost.client import ChildToken, GrantRef, PoolClient
from poolkeeper.workerhost.worker import CHILD_TOKEN_ENV, URL_ENV, grant_from_env


@dataclass(frozen=True)
class Child:
    """A child execution registered under the call's grant (``Context.child``).

    ``heartbeat`` and ``result`` raise ``StaleHolder`` once the child or its grant has ended:
    the child's work must stop. ``env`` is what a process doing the child's work needs beside the
    grant's environment for ``poolctl child heartbeat`` and ``result``.
    """

    id: str
    epoch: int  # the grant's fence, which every report of the child carries
    depth: int
    _client: PoolClient = field(repr=False)
    _holder: GrantRef = field(repr=False)

    @property
    def env(self) -> dict[str, str]:
        return {"POOL_CHILD_ID": self.id}

    def heartbeat(self, receipt: Mapping[str, Any] | None = None) -> str:
        """The child is alive (``registered`` turns ``running``), with its latest receipt if given."""
        return self._client.child_heartbeat(ChildToken(self.id, self.epoch), receipt)

    def result(self, payload: Mapping[str, Any]) -> str:
        """The child's result: it turns terminal with its own children; ``applied`` or ``duplicate``."""
        return self._client.child_result(ChildToken(self.id, self.epoch), payload)

    def vanished(self) -> int:
        """Its process is gone: it and its live descendants turn ``unknown``; how many did."""
        return self._client.child_vanished(self._holder, self.id)


@dataclass
class Context:
    """One call's grant: its payload, the run's names, a cancellation check and its children."""

    payload: dict[str, Any]
    board: str
    task_id: str
    run_id: int
    row_id: int
    attempt: int
    fence: int
    owner: str
    _cancel: threading.Event = field(default_factory=threading.Event, repr=False)
    _url: str = field(default="", repr=False)
    _child_token: str | None = field(default=None, repr=False)
    _client: PoolClient | None = field(default=None, repr=False)

    @classmethod
    def of(cls, payload: dict[str, Any], env: Mapping[str, str], cancel: threading.Event) -> Context:
        """The context of a grant described as ``worker.grant_env`` describes it to a command."""
        ref = grant_from_env(env)
        return cls(
            payload,
            env["POOL_BOARD"],
            env["POOL_TASK_ID"],
            int(env["POOL_RUN_ID"]),
            ref.row_id,
            ref.attempt,
            ref.fence,
            ref.owner,
            cancel,
            env[URL_ENV],
            env.get(CHILD_TOKEN_ENV),
        )

    def cancelled(self) -> bool:
        """True once the run is no longer this worker's (a heartbeat was refused) or it is stopping.

        An async callable is cancelled as well (``CancelledError`` at its next ``await``); this is
        for work between awaits. A sync callable's process is ended instead, so it never sees True
        for long.
        """
        return self._cancel.is_set()

    def child(self, *, key: str | None = None, under: Child | str | None = None) -> Child:
        """Register a child under this grant (or nested under a live child ``under``).

        The same ``key`` under the same grant and parent is the same child (a retried call, or a
        re-run callable, gets the one registered before).
        """
        parent = under.id if isinstance(under, Child) else under
        got = self._pool().register_child(self._ref(), under=parent, key=key)
        return Child(got.child_id, got.epoch, got.depth, self._pool(), self._ref())

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    def _ref(self) -> GrantRef:
        return GrantRef(self.row_id, self.attempt, self.fence, self.owner)

    def _pool(self) -> PoolClient:
        if self._client is None:
            self._client = PoolClient(self._url, self._child_token)
        return self._client
