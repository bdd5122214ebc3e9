"""Input checks for everything that enters the store from outside.

Each check raises ``InvalidInput`` naming the field and what was wrong, before
anything is written. Integers are bounded by the column they end up in
(``INT32_MAX`` for ``Integer``, ``INT64_MAX`` for ``BigInteger``). JSON
documents are walked without recursion (bounded depth and size, string keys,
valid Unicode) and canonicalised for digests; keys that look like credentials
are refused (docs/design.md, invariant 7: no secret is stored).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from typing import Any

from core.errors import InvalidInput

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]*")
DIGEST_RE = re.compile(r"[0-9a-f]{64}")
MAX_DOCUMENT_BYTES = 64 * 1024
MAX_DEPTH = 64  # containers nested at most this deep; far below the interpreter's recursion limit
INT32_MAX = 2**31 - 1  # an ``Integer`` column (SQLAlchemy: 32-bit on PostgreSQL)
INT64_MAX = 2**63 - 1  # a ``BigInteger`` column (and any SQLite integer)
_SURROGATE_RE = re.compile("[\ud800-\udfff]")
MAX_ROW_ID = INT32_MAX  # a pool row id is an ``Integer`` column
MAX_POOL_SIZE = 100_000  # POOL_SIZE's ceiling: ordinals are 0..MAX_POOL_SIZE-1 at most
MAX_OFFER_WAIT_SECONDS = 60.0  # the longest an offer may ask to wait (the server caps it lower)
SECRET_KEY_RE = re.compile(
    r"passw(or)?d|passphrase|secret|token|api[_-]?key|access[_-]?key|private[_-]?key"
    r"|credential|(^|[_-])auth($|[_-]|orization)|cookie|session[_-]?id",
    re.IGNORECASE,
)


def name(field: str, value: object, max_len: int) -> str:
    """A board name, task id or delivery id: short, printable, no quoting tricks."""
    if not isinstance(value, str):
        raise InvalidInput(field, f"expected a string, got {type(value).__name__}")
    if not 1 <= len(value) <= max_len:
        raise InvalidInput(field, f"must be 1 to {max_len} characters, got {len(value)}")
    if not NAME_RE.fullmatch(value):
        raise InvalidInput(
            field, "may hold only letters, digits and _ . : - (and start with a letter or digit)"
        )
    return value


def integer(field: str, value: object, low: int, high: int) -> int:
    """An integer in ``[low, high]``; ``high`` is at most the column's range (``INT32_MAX``/``INT64_MAX``)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(field, f"expected an integer, got {type(value).__name__}")
    if not low <= value <= high:
        shown = str(value) if value.bit_length() <= 64 else f"an integer of {value.bit_length()} bits"
        raise InvalidInput(field, f"must be between {low} and {high}, got {shown}")
    return value


def ordinal(field: str, value: object, pool_size: int) -> int:
    """A worker ordinal ``0..pool_size-1`` (an ``Integer`` column)."""
    return integer(field, value, 0, min(pool_size, INT32_MAX + 1) - 1)


def digest_field(field: str, value: object) -> str:
    if not isinstance(value, str) or not DIGEST_RE.fullmatch(value):
        raise InvalidInput(field, "expected a lowercase hex SHA-256 digest (64 characters)")
    return value


def document(field: str, value: object) -> str:
    """A JSON object with no credential-like keys, as canonical text."""
    if not isinstance(value, Mapping):
        raise InvalidInput(field, f"expected a JSON object, got {type(value).__name__}")
    _check_tree(field, value)
    try:
        text = canonical_json(value)
    except (TypeError, ValueError, RecursionError) as err:
        raise InvalidInput(field, f"not JSON-serialisable: {err}") from None
    if len(text.encode()) > MAX_DOCUMENT_BYTES:
        raise InvalidInput(field, f"larger than {MAX_DOCUMENT_BYTES} bytes")
    return text


def text(field: str, value: object) -> str:
    """Free text a database can hold: a string of valid UTF-8 (no lone surrogate) without NUL."""
    if not isinstance(value, str):
        raise InvalidInput(field, f"expected a string, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InvalidInput(field, f"not valid UTF-8 (a lone surrogate at position {err.start})") from None
    if "\x00" in value:
        raise InvalidInput(field, "must not contain a NUL character")
    return value


def storable(value: str, limit: int) -> str:
    """``value`` cut to ``limit`` characters that any database holds: NUL and lone surrogates replaced.

    For text the store writes from what it caught rather than what it was given (an
    error's message, evidence quoted from elsewhere): never refused, only made safe.
    """
    cut = value[:limit].replace("\x00", "\ufffd")
    return cut.encode("utf-8", "replace").decode("utf-8")


def run_payload(*, board: str, task_id: str, run_id: int, title: str, body: str) -> dict[str, Any]:
    """What a pool worker receives for one run of a board task; ``InvalidInput`` if it cannot be built.

    A body holding a JSON object is passed on as ``input``, too. The payload is a
    ``document``: at most ``MAX_DOCUMENT_BYTES`` as JSON, no credential-like keys.
    Materialize builds it for each claim; ``Board.add_task`` builds it (with the
    largest run id) to refuse a task the pool could never serve.
    """
    payload: dict[str, Any] = {
        "board": board,
        "task_id": task_id,
        "run_id": run_id,
        "title": text("title", title),
        "body": text("body", body),
    }
    if body.lstrip().startswith("{"):
        payload["input"] = loads("body", body)  # looks like JSON, so it must be
        document("body", payload["input"])  # depth, keys, credentials: named body.<path>
    size = len(canonical_json(payload).encode())  # the tree was walked: it serialises
    if size > MAX_DOCUMENT_BYTES:
        longer = "title" if len(title) > len(body) else "body"
        raise InvalidInput(
            longer, f"too long: the run's payload would be {size} bytes, at most {MAX_DOCUMENT_BYTES}"
        )
    document("payload", payload)
    return payload


def loads(field: str, text: str) -> Any:
    """JSON text a person or a program gave, parsed; ``InvalidInput`` naming ``field`` if it is not
    JSON, nests deeper than the decoder can follow, says NaN or Infinity, or repeats a key in one
    object (parsers disagree on which one wins, so the text would not mean one thing)."""
    try:
        return json.loads(text, parse_constant=_no_constant, object_pairs_hook=_unique_keys)
    except ValueError as err:  # JSONDecodeError too
        raise InvalidInput(field, f"not JSON: {err}") from None
    except RecursionError:  # the decoder recurses: nesting this deep is refused like any other
        raise InvalidInput(field, f"JSON nested deeper than {MAX_DEPTH} levels") from None


def repeated_key(raw: str | bytes) -> str | None:
    """Why JSON text repeats a key in one of its objects (one sentence), or None: for a request body,
    which its framework parses last-one-wins. Text that is not JSON is None here (its parser says why)."""
    try:
        json.loads(raw, object_pairs_hook=_unique_keys)
    except _RepeatedKey as err:
        return str(err)
    except (ValueError, RecursionError):
        return None
    return None


class _RepeatedKey(ValueError):
    pass


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} has no JSON form")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise _RepeatedKey(f"the key {label(key)} appears twice in one object")
        found[key] = value
    return found


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def label(key: str, max_len: int = 64) -> str:
    """A key as it may appear in an error message: itself if name-like, else an escaped excerpt."""
    if len(key) <= max_len and NAME_RE.fullmatch(key):
        return key
    return ascii(key[:max_len])


def _check_tree(field: str, root: Mapping[Any, Any]) -> None:
    """Walk a document with an explicit stack (no recursion), refusing at the first problem.

    ``budget`` counts down a lower bound of the canonical text's size, so an
    enormous document is refused before it is walked in full or serialised.
    """
    budget = MAX_DOCUMENT_BYTES
    stack: list[tuple[Any, str, int]] = [(root, field, 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            budget -= len(value) + 2
        elif value is None or isinstance(value, bool | int | float):
            budget -= 1
        elif isinstance(value, Mapping | list | tuple):
            budget -= 1 + len(value)
        if budget < 0:
            raise InvalidInput(field, f"larger than {MAX_DOCUMENT_BYTES} bytes")
        if isinstance(value, str):
            _storable(path, value, "")
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise InvalidInput(path, "not JSON: NaN and Infinity have no JSON form")
        elif isinstance(value, int) and not isinstance(value, bool):
            if not -INT64_MAX - 1 <= value <= INT64_MAX:
                raise InvalidInput(path, "integers must fit in 64 bits (send a string instead)")
        elif isinstance(value, Mapping | list | tuple):
            if depth > MAX_DEPTH:
                raise InvalidInput(path, f"nested deeper than {MAX_DEPTH} levels")
            children: list[tuple[Any, str, int]] = []
            if isinstance(value, Mapping):
                for key, item in value.items():
                    if not isinstance(key, str):
                        raise InvalidInput(path, f"object keys must be strings, got {type(key).__name__}")
                    budget -= len(key) + 3
                    if budget < 0:
                        raise InvalidInput(field, f"larger than {MAX_DOCUMENT_BYTES} bytes")
                    where = _child(path, f".{label(key)}")
                    _storable(where, key, "key ")
                    if SECRET_KEY_RE.search(key):
                        raise InvalidInput(where, "looks like a credential; secrets are never stored")
                    children.append((item, where, depth + 1))
            else:
                children = [(item, _child(path, f"[{i}]"), depth + 1) for i, item in enumerate(value)]
            stack.extend(reversed(children))  # so the first problem in document order is named
        elif value is not None and not isinstance(value, bool | int):
            raise InvalidInput(path, f"not a JSON value: {type(value).__name__}")


def _storable(path: str, value: str, what: str) -> None:
    """A document's string (``what``: "key " for a key) holds neither a lone surrogate nor a NUL,
    which no database here stores as given (SPEC: refused, never stored)."""
    if _SURROGATE_RE.search(value):
        raise InvalidInput(path, f"{what}holds a lone surrogate; strings must be valid Unicode")
    if "\x00" in value:
        raise InvalidInput(path, f"{what}must not contain a NUL character")


def _child(path: str, step: str, max_len: int = 200) -> str:
    """A child's path for error messages, cut short (once, with "…") past ``max_len``."""
    if len(path) >= max_len:
        return path if path.endswith("…") else path + "…"
    return path + step


# C0 and C1 controls, DEL, and the bidirectional overrides that reorder what a screen shows.
_BIDI = frozenset(range(0x202A, 0x202F)) | frozenset(range(0x2066, 0x206A)) | {0x200E, 0x200F, 0x061C}


def _escaped(ch: str) -> str:
    n = ord(ch)
    if n < 0x20 or 0x7F <= n < 0xA0:
        return f"\\x{n:02x}"
    return f"\\u{n:04x}" if n in _BIDI else ch


def shown(raw: str) -> str:
    """``raw`` as a terminal or a page may show it: each control character escaped (``\\x1b``)."""
    if raw.isprintable() and not any(ord(c) in _BIDI for c in raw):
        return raw
    return "".join(_escaped(c) for c in raw)


def read_file(path: str, limit: int) -> str:
    """A regular file's UTF-8 text, at most ``limit`` bytes: ``ValueError`` saying why not, so a
    FIFO, a device (``/dev/zero``) or a file past the limit is refused, never read without end."""
    import os
    import stat

    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO's open would wait for a writer
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # before open(): a directory's would raise
            raise ValueError("not a regular file")
        data = os.read(fd, limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise ValueError(f"larger than {limit} bytes")
    return data.decode("utf-8")
