"""A Python client of the wire protocol (``poolctl serve``), for pool workers on other hosts.

``PoolClient`` posts JSON with its ordinal's bearer token. A busy store (503)
or a broken connection is retried with exponential backoff and jitter
(``core.retry.RetryPolicy``), at least as long as ``Retry-After`` asks; a retry
of one call sends the same delivery id, so the store answers a delivery that
already landed with ``duplicate``. Refusals come back as the project's errors,
by the class the server names when the status is the one that class carries
(``http_status``, docs/design.md section 6): ``StaleHolder``, ``DeliveryConflict``
and the other ``ProtocolError`` classes, ``NotFound``, ``InvalidInput``;
``AccessDenied`` (also a ``core.errors.Denied``) for 401 and 403, ``Refused`` for
anything else (408, 413); ``TransientError`` once the retries are spent
(``Unavailable`` when the last try could not connect).
``check_url`` says up front whether a URL can reach a server at all
(``poolctl worker`` and ``poolctl child`` call it).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import httpx

from core import errors, tracing
from core.errors import InvalidInput, NotFound, PoolError, ProtocolError, TransientError, UnusableURL
from core.retry import RetryPolicy
from core.shapes import Offer

CLIENT_RETRY = RetryPolicy(base_seconds=0.2, max_seconds=5.0)  # 0.1-0.2 s, 0.2-0.4 s, ... up to 2.5-5 s
# The refusals of a request the server names by class; each is known again by its name when the
# answer's status is the one the class carries (``http_status``). A 409 or 422 of another name is
# the general class carrying that status.
_REFUSALS: tuple[type[PoolError], ...] = (InvalidInput, NotFound, ProtocolError)


def _descendants(cls: type[PoolError]) -> list[type[PoolError]]:
    return [cls, *(d for sub in cls.__subclasses__() for d in _descendants(sub))]


_BY_NAME = {d.__name__: d for cls in _REFUSALS for d in _descendants(cls)}
_BY_STATUS = {cls.http_status: cls for cls in (InvalidInput, ProtocolError)}


class Refused(PoolError):
    """The server refused the caller or the request itself: 401, 403, 408, 413, or an unexpected answer."""

    def __init__(self, status: int, error: str, detail: str) -> None:
        super().__init__(f"{status} {error}: {detail}")
        self.status, self.error, self.detail = status, error, detail


class AccessDenied(Refused, errors.Denied):
    """401 or 403: the server will not take this token (wrong secret, another ordinal, a child token)."""


def check_url(name: str, url: str) -> str:
    """``url`` if an HTTP client can try it: http or https, a host, a port that exists.

    Else ``UnusableURL`` naming ``name`` (``poolctl`` exits 78: retrying cannot help); the URL is
    not echoed, as it may hold a password.
    """
    try:
        parsed = httpx.URL(url)
        port = parsed.port
    except (httpx.InvalidURL, ValueError, TypeError) as err:
        raise UnusableURL(f"{name}: not a URL ({str(err)[:80]})") from None
    if parsed.scheme not in ("http", "https"):
        raise UnusableURL(f"{name}: {parsed.scheme or 'no'} scheme; expected an http:// or https:// URL")
    if not parsed.host or any(c in parsed.host for c in "% \t"):
        raise UnusableURL(f"{name}: no usable host; expected http://HOST:PORT of `poolctl serve`")
    if port is not None and not 0 < port < 65536:
        raise UnusableURL(f"{name}: port {port} does not exist")
    return url


@dataclass(frozen=True)
class Grant(Offer):
    """A grant as ``offer`` returns it: ``store.Offer`` (declared in ``core.shapes``, which a pool
    worker loads without the store), with the lease's length and the grant's child token."""

    lease_seconds: float = field(kw_only=True)
    child_token: str | None = field(default=None, repr=False, kw_only=True)  # its /v1/children calls only

    def envelope(self, delivery_id: str | None = None, **extra: Any) -> dict[str, Any]:
        """The envelope naming this exact holder (``extra``: ``payload`` for a result)."""
        return envelope(self, delivery_id, **extra)

    def ref(self) -> GrantRef:
        """What registering a child under this grant (or reporting one vanished) names."""
        return GrantRef(self.row_id, self.attempt, self.fence, self.owner)


@dataclass(frozen=True)
class GrantRef:
    """A grant's holder by the four fields that name it (``poolctl worker`` hands them to its command)."""

    row_id: int
    attempt: int
    fence: int
    owner: str

    def body(self, **extra: Any) -> dict[str, Any]:
        return {
            "row_id": self.row_id,
            "attempt": self.attempt,
            "fence": self.fence,
            "owner": self.owner,
            **extra,
        }


@dataclass(frozen=True)
class ChildToken:
    """What a child reports with: its id and the epoch (its grant's fence) it was registered under."""

    child_id: str
    epoch: int


@dataclass(frozen=True)
class Child(ChildToken):
    """A registered child, as ``register_child`` returns it."""

    row_id: int
    parent_id: str
    depth: int


_GRANT_FIELDS = frozenset(f.name for f in fields(Grant)) - {"lease_seconds"}


def new_delivery_id() -> str:
    return uuid.uuid4().hex


def envelope(holder: Offer, delivery_id: str | None = None, **extra: Any) -> dict[str, Any]:
    """The envelope of a heartbeat, result or release naming this exact holder (a grant, or an offer)."""
    return {
        "delivery_id": delivery_id or new_delivery_id(),
        "board": holder.board,
        "task_id": holder.task_id,
        "run_id": holder.run_id,
        "worker_ordinal": holder.ordinal,
        "attempt": holder.attempt,
        "fence": holder.fence,
        "payload_digest": holder.payload_digest,
        **extra,
    }


class PoolClient:
    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        timeout: float = 10.0,
        retry: RetryPolicy = CLIENT_RETRY,
        tries: int = 6,
        transport: httpx.BaseTransport | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.url = url.rstrip("/")
        base = httpx.URL(self.url)
        host = f"[{base.host}]" if ":" in base.host else base.host
        port = "" if base.port is None else f":{base.port}"
        self._where = f"{base.scheme}://{host}{port}"  # what errors name: never a password
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(
            base_url=url.rstrip("/"), headers=headers, timeout=timeout, transport=transport
        )
        self.retry, self.tries, self.sleep, self.timeout = retry, max(tries, 1), sleep, timeout

    def __enter__(self) -> PoolClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # --- the protocol ------------------------------------------------------------

    def offer(self, ordinal: int, owner: str, *, wait: float = 0.0) -> Grant | None:
        """The ordinal's grant, or None; ``wait`` > 0 lets the server hold the answer that long for
        one to be assigned (the call's timeout grows by as much)."""
        body: dict[str, Any] = {"ordinal": ordinal, "owner": owner}
        if wait > 0:
            body["wait"] = wait
        got = self._call("POST", "/v1/offer", body, extra_seconds=wait)
        grant = got["grant"]
        if grant is None:
            return None
        known = {k: v for k, v in grant.items() if k in _GRANT_FIELDS}  # a newer server may send more
        return Grant(**known, lease_seconds=float(got["lease_seconds"]))

    def heartbeat(self, grant: Grant, delivery_id: str | None = None) -> str:
        return self.send("heartbeat", grant.envelope(delivery_id))

    def deliver(self, grant: Grant, result: Mapping[str, Any], delivery_id: str | None = None) -> str:
        return self.send("result", grant.envelope(delivery_id, payload=dict(result)))

    def release(self, grant: Grant, delivery_id: str | None = None) -> str:
        return self.send("release", grant.envelope(delivery_id))

    # --- child executions (docs/design.md, "Lineage") --------------------------------

    def register_child(self, holder: GrantRef, *, under: str | None = None, key: str | None = None) -> Child:
        """Register a child under ``holder``'s grant (or under its live child ``under``).

        A key is always sent (a random one unless given), so a retry of this call
        after a lost answer returns the child already registered, not a second one.
        """
        body = holder.body(key=key or new_delivery_id(), **({} if under is None else {"under": under}))
        got = self._call("POST", "/v1/children", body)
        return Child(**{f.name: got[f.name] for f in fields(Child)})

    def child_heartbeat(self, child: ChildToken, receipt: Mapping[str, Any] | None = None) -> str:
        extra = {} if receipt is None else {"receipt": dict(receipt)}
        return self._child_report("heartbeat", child, extra)

    def child_result(self, child: ChildToken, payload: Mapping[str, Any]) -> str:
        return self._child_report("result", child, {"payload": dict(payload)})

    def child_vanished(self, holder: GrantRef, child_id: str) -> int:
        """The holder lost the child's worker: how many (it and its live descendants) turned unknown."""
        return int(self._call("POST", "/v1/children/vanished", holder.body(child_id=child_id))["unknown"])

    def _child_report(self, kind: str, child: ChildToken, extra: dict[str, Any]) -> str:
        body = {"child_id": child.child_id, "epoch": child.epoch, **extra}
        return str(self._call("POST", f"/v1/children/{kind}", body)["outcome"])

    def send(self, kind: str, envelope: Mapping[str, Any]) -> str:
        """Post a ready envelope to ``heartbeat``, ``result`` or ``release``; its outcome."""
        return str(self._call("POST", f"/v1/{kind}", dict(envelope))["outcome"])

    # --- transport ---------------------------------------------------------------

    def _call(
        self, method: str, path: str, body: dict[str, Any] | None = None, *, extra_seconds: float = 0.0
    ) -> dict[str, Any]:
        """One call, retried as is (same body, so the same delivery id) while transient; a server that
        may hold its answer (a waiting offer) gets ``extra_seconds`` more to read it."""
        timeout: Any = httpx.USE_CLIENT_DEFAULT
        if extra_seconds > 0:
            timeout = httpx.Timeout(self.timeout, read=self.timeout + extra_seconds)
        for n in range(1, self.tries + 1):
            wait = self.retry.backoff(n)
            refused = False
            try:
                # the caller's trace (its span, or TRACEPARENT): the server's span is its child
                response = self._http.request(
                    method, path, json=body, timeout=timeout, headers=tracing.headers() or None
                )
            except httpx.TransportError as err:
                problem = f"{self._where}{path}: {type(err).__name__}: {err}"
                refused = isinstance(err, httpx.ConnectError)
            else:
                if response.status_code < 300:
                    found: dict[str, Any] = response.json()
                    return found
                if response.status_code != 503:
                    raise _refusal(response)
                problem = f"{path}: 503 {_body(response).get('detail', '')}"
                wait = max(wait, _retry_after(response))
            if n < self.tries:
                self.sleep(wait)
        # nothing listening (or no such host), to the last try: unavailable, not busy (poolctl: 69, not 75)
        raise (errors.Unavailable if refused else TransientError)(f"{problem} (after {self.tries} tries)")


def _body(response: httpx.Response) -> dict[str, Any]:
    try:
        found = response.json()
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


def _retry_after(response: httpx.Response) -> float:
    try:
        return min(float(response.headers.get("retry-after", "0")), 60.0)
    except ValueError:
        return 0.0


def _refusal(response: httpx.Response) -> PoolError:
    body = _body(response)
    error, detail = str(body.get("error", "")), body.get("detail", response.text[:200])
    text = (
        detail
        if isinstance(detail, str)
        else "; ".join(
            f"{'.'.join(map(str, d.get('loc', ())))}: {d.get('msg', '')}"
            for d in detail
            if isinstance(d, dict)
        )
    )
    status = response.status_code
    if status in (errors.Unauthenticated.http_status, errors.Forbidden.http_status):
        return AccessDenied(status, error or "HTTPError", text)
    named = _BY_NAME.get(error)
    cls = named if named is not None and named.http_status == status else _BY_STATUS.get(status)
    if cls is None:
        return Refused(status, error or "HTTPError", text)
    if issubclass(cls, InvalidInput):
        name, _, problem = text.partition(": ")
        return InvalidInput(name, problem) if problem else InvalidInput("request", text)
    return cls(text)


class HttpPool:
    """The store's worker API (``offer``, ``heartbeat``, ``accept_result``, ``release``) over HTTP.

    One ``PoolClient`` per ordinal, each with that ordinal's token (``tokens[ordinal]``; ``None``
    for a ``--local-only`` server): what the simulated workers use in the demo.
    """

    def __init__(
        self,
        url: str,
        tokens: Mapping[int, str | None],
        *,
        pool_size: int,
        lease_seconds: float,
        **options: Any,
    ) -> None:
        self.pool_size, self.lease_seconds = pool_size, lease_seconds
        self.clients = {o: PoolClient(url, tokens.get(o), **options) for o in range(pool_size)}

    def offer(self, ordinal: int, *, owner: str) -> Grant | None:
        return self.clients[ordinal].offer(ordinal, owner)

    def heartbeat(self, envelope: Mapping[str, Any]) -> str:
        return self._client(envelope).send("heartbeat", envelope)

    def accept_result(self, envelope: Mapping[str, Any]) -> str:
        return self._client(envelope).send("result", envelope)

    def release(self, envelope: Mapping[str, Any]) -> str:
        return self._client(envelope).send("release", envelope)

    def close(self) -> None:
        for client in self.clients.values():
            client.close()

    def _client(self, envelope: Mapping[str, Any]) -> PoolClient:
        ordinal = envelope.get("worker_ordinal")
        if not isinstance(ordinal, int) or ordinal not in self.clients:
            raise InvalidInput("worker_ordinal", f"not an ordinal of this pool: {ordinal!r}")
        return self.clients[ordinal]
