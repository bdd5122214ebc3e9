"""Input checks for everything that enters the store from outside.

Each check raises ``InvalidInput`` naming the field and what was wrong, before
anything is written. JSON documents are canonicalised for digests; keys that
look like credentials are refused (docs/design.md, invariant 7: no secret is stored).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any

from core.errors import InvalidInput

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]*")
DIGEST_RE = re.compile(r"[0-9a-f]{64}")
MAX_DOCUMENT_BYTES = 64 * 1024
# Row ids, run ids and fences are at most 63-bit: a SQLite INTEGER, a PostgreSQL BIGINT.
MAX_ID = 2**63 - 1
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


def integer(field: str, value: object, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(field, f"expected an integer, got {type(value).__name__}")
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f">= {low}"
        raise InvalidInput(field, f"must be {bound}, got {value}")
    return value


def digest_field(field: str, value: object) -> str:
    if not isinstance(value, str) or not DIGEST_RE.fullmatch(value):
        raise InvalidInput(field, "expected a lowercase hex SHA-256 digest (64 characters)")
    return value


def document(field: str, value: object) -> str:
    """A JSON object with no credential-like keys, as canonical text."""
    if not isinstance(value, Mapping):
        raise InvalidInput(field, f"expected a JSON object, got {type(value).__name__}")
    secret = _secret_key_path(value, field)
    if secret:
        raise InvalidInput(secret, "looks like a credential; secrets are never stored")
    try:
        text = canonical_json(value)
    except (TypeError, ValueError) as err:
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


def run_payload(*, board: str, task_id: str, run_id: int, title: str, body: str) -> dict[str, Any]:
    """What a pool worker receives for one run of a board task; ``InvalidInput`` if it cannot be built.

    A body holding a JSON object is passed on as ``input``, too. The payload is a
    ``document``: at most ``MAX_DOCUMENT_BYTES`` as JSON, no credential-like keys.
    Materialize builds it for each claim; ``KanbanBoard.add_task`` builds it (with the
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
        try:
            payload["input"] = json.loads(body)
        except ValueError as err:
            raise InvalidInput("body", f"looks like JSON but is not: {err}") from None
    try:
        size = len(canonical_json(payload).encode())
    except ValueError as err:
        raise InvalidInput("body", f"not JSON-serialisable: {err}") from None
    if size > MAX_DOCUMENT_BYTES:
        longer = "title" if len(title) > len(body) else "body"
        raise InvalidInput(
            longer, f"too long: the run's payload would be {size} bytes, at most {MAX_DOCUMENT_BYTES}"
        )
    if "input" in payload:
        document("body", payload["input"])  # a credential-like key is named body.<key>
    document("payload", payload)
    return payload


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _secret_key_path(value: Any, path: str) -> str | None:
    if isinstance(value, Mapping):
        for key, item in value.items():
            where = f"{path}.{key}"
            if isinstance(key, str) and SECRET_KEY_RE.search(key):
                return where
            found = _secret_key_path(item, where)
            if found:
                return found
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            found = _secret_key_path(item, f"{path}[{i}]")
            if found:
                return found
    return None
