"""A pool worker's state directory, one per ordinal and host: what a restarted worker must find.

``<state dir>/ordinal-<N>/`` (mode 0700) holds:

- ``lock``: an exclusive ``flock`` held for the worker's life, so two live workers cannot
  serve one ordinal from one host (the second refuses to start: ``TransientError``, exit 75);
- ``group.json``: the running command's process group: its id, its leader's start time
  (``/proc/<pid>/stat``, clock ticks since boot) and the boot id, so that a reused pid is
  never taken for it; written when the command starts, removed once the group is gone;
- ``result.json``: a finished command's result with the grant it answers (row, attempt,
  fence, owner, digest) and its delivery id; written before the first delivery, removed
  once the store accepted or refused it.

Files are replaced atomically (a temporary file, fsync, rename, fsync of the directory).
The default (``default_dir``) is ``<base>/pool-<digest of the server URL>``, the base
``$XDG_RUNTIME_DIR/poolkeeper``, else ``/run/poolkeeper`` for root, else
``<tmp>/poolkeeper-<uid>``: a runtime directory, emptied at boot, which ends every process
and lease the files could name. The URL's digest keeps the workers of two pools on one
host (two servers, or a test beside a deployment) out of each other's ordinals; a
supervisor that may change how it spells the URL names the directory (``--state-dir``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.errors import TransientError

log = logging.getLogger("poolkeeper.workerhost.worker")
PROC = Path("/proc")
GROUP, RESULT = "group.json", "result.json"


def default_dir(url: str) -> Path:
    """Where the workers of the pool served at ``url`` keep their ordinals' state on this host."""
    pool = f"pool-{hashlib.sha256(url.encode()).hexdigest()[:16]}"
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if runtime:
        return Path(runtime) / "poolkeeper" / pool
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        return Path("/run/poolkeeper") / pool
    return Path(tempfile.gettempdir()) / f"poolkeeper-{os.getuid()}" / pool


class StateDir:
    """One ordinal's directory; ``lock`` first, then read and write its records."""

    def __init__(self, base: Path, ordinal: int) -> None:
        self.path = base / f"ordinal-{ordinal}"
        self._lock: int | None = None

    def lock(self) -> None:
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.path / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise TransientError(
                f"another worker holds {self.path}: two workers cannot serve one ordinal from one host"
            ) from None
        self._lock = fd

    def unlock(self) -> None:
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def read(self, name: str) -> dict[str, Any] | None:
        """A record, or None; one that does not parse is reported and removed."""
        try:
            found = json.loads((self.path / name).read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as err:
            log.warning("%s: unreadable, removed: %s", self.path / name, err)
            self.remove(name)
            return None
        return found if isinstance(found, dict) else None

    def write(self, name: str, record: dict[str, Any]) -> None:
        tmp = self.path / f".{name}.tmp"
        with tmp.open("w") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path / name)
        self._sync()

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.path / name).unlink()
            self._sync()

    def _sync(self) -> None:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# --- process groups ----------------------------------------------------------------


@dataclass(frozen=True)
class Group:
    """A process group by its id and what tells it from a later group that reuses the number."""

    pgid: int
    start: int = 0  # its leader's start time in clock ticks since boot (0: not known)
    boot: str = ""

    @classmethod
    def of(cls, leader: int) -> Group:
        stat = _stat(leader)
        return cls(leader, stat[2] if stat else 0, _boot_id())

    @classmethod
    def load(cls, record: dict[str, Any]) -> Group | None:
        try:
            return cls(int(record["pgid"]), int(record.get("start", 0)), str(record.get("boot", "")))
        except (KeyError, TypeError, ValueError):
            return None

    def record(self) -> dict[str, Any]:
        return {"pgid": self.pgid, "start": self.start, "boot": self.boot}

    def members(self) -> list[int] | None:
        """Its live (not zombie) processes; None where that cannot be told (no ``/proc``)."""
        if not (PROC / "self" / "stat").exists():
            return None
        if self.boot and self.boot != _boot_id():
            return []
        leader = _stat(self.pgid)
        if leader and leader[1] == self.pgid and self.start and leader[2] != self.start:
            return []  # the number leads another group now: ours is gone
        found = []
        for entry in PROC.iterdir():
            if entry.name.isdigit():
                stat = _stat(int(entry.name))
                if stat and stat[1] == self.pgid and stat[0] not in "ZX" and stat[2] >= self.start:
                    found.append(int(entry.name))
        return found

    def alive(self) -> bool:
        members = self.members()
        if members is not None:
            return bool(members)
        try:
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def end(self, grace: float, *, reap: Callable[[], object] = lambda: None) -> bool:
        """SIGTERM the group, SIGKILL it after ``grace`` seconds; True once it is gone (at most 10 s more).

        ``reap`` is called while waiting, so a leader that is this process's child is
        not kept as a zombie.
        """
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            reap()
            if not self.alive():
                return True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pgid, sig)
            if self.wait_gone(wait, reap=reap):
                return True
        return False

    def wait_gone(
        self,
        seconds: float | None,
        *,
        reap: Callable[[], object] = lambda: None,
        stopping: threading.Event | None = None,
    ) -> bool:
        """Poll until the group is gone (True), ``seconds`` pass (None: no limit) or ``stopping``."""
        deadline = None if seconds is None else time.monotonic() + seconds
        while True:
            reap()
            if not self.alive():
                return True
            if deadline is not None and time.monotonic() > deadline:
                return False
            if stopping is not None and stopping.is_set():
                return False
            time.sleep(0.05)


def end_predecessor(state: StateDir, grace: float, stopping: threading.Event) -> bool:
    """End the process group an earlier run on this ordinal left running; True once none lives.

    Called before every offer: the group a previous worker left, or one of this worker's own
    that outlived SIGKILL, is named in the state directory until it is gone.

    Where the group cannot be verified as that worker's (no ``/proc``) or cannot be
    signalled, one line says so and this waits for it to exit on its own.
    """
    group = Group.load(state.read(GROUP) or {})
    if group is None or not group.alive():
        state.remove(GROUP)
        return True
    if group.members() is None:
        log.warning(
            "process group %d of an earlier run may live (no /proc to tell, so not signalled): "
            "waiting for it to exit before taking a grant",
            group.pgid,
        )
        gone = group.wait_gone(None, stopping=stopping)
    else:
        log.warning("ending process group %d, which an earlier run on this ordinal left running", group.pgid)
        try:
            gone = group.end(grace)
        except PermissionError:
            log.warning("cannot signal process group %d: waiting for it to exit", group.pgid)
            gone = group.wait_gone(None, stopping=stopping)
        if not gone:
            log.warning("process group %d outlived SIGKILL: waiting for it to exit", group.pgid)
            gone = group.wait_gone(None, stopping=stopping)
    if gone:
        state.remove(GROUP)
    return gone


def _stat(pid: int) -> tuple[str, int, int] | None:
    """State, process group and start time of ``pid`` from ``/proc/<pid>/stat``; None if it is gone."""
    try:
        raw = (PROC / str(pid) / "stat").read_bytes()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2 :].split()  # after the command name, which may hold anything
    try:
        return fields[0].decode(), int(fields[2]), int(fields[19])
    except (IndexError, ValueError):
        return None


def _boot_id() -> str:
    try:
        return (PROC / "sys" / "kernel" / "random" / "boot_id").read_text().strip()
    except OSError:
        return sys.platform
