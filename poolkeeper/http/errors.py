"""Every refusal as JSON ``{"error": <class>, "detail": ...}``.

A project error answers with the status its class carries (``http_status``, the
table in docs/design.md section 6): a 503 adds ``Retry-After``, a 401
``WWW-Authenticate: Bearer``. Request validation is 422, a database error the
store did not classify 503 (logged: a bug or a broken store), and a body too
large or too slow 413 / 408 (``limits``). Anything else is a bug: logged by the
server, answered 500 with no detail. The tests drive every route with generated
input (schemathesis) and see no 5xx but 503.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from sqlalchemy.exc import SQLAlchemyError
from starlette.exceptions import HTTPException

from core.errors import PoolError

log = logging.getLogger("poolkeeper.server")
RETRY_AFTER_SECONDS = 1


class Issue(BaseModel):
    loc: list[str | int]
    msg: str
    type: str


class ErrorBody(BaseModel):
    error: str = Field(description="The error's class, e.g. StaleHolder, InvalidInput, TransientError.")
    detail: str | list[Issue]


class Health(BaseModel):
    status: Literal["ok", "ready"]


def refusals(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The refusals a route declares in the schema, beside the 401, 413 and 422 every route may give."""
    return {code: {"model": ErrorBody} for code in (*codes, 401, 413, 422)}


def error_response(
    status: int, error: str, detail: Any, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse({"error": error, "detail": detail}, status_code=status, headers=headers)


def _busy(error: str, detail: str) -> JSONResponse:
    return error_response(503, error, detail, {"Retry-After": str(RETRY_AFTER_SECONDS)})


def pool_error(_: Request, err: Exception) -> JSONResponse:
    assert isinstance(err, PoolError)
    status, name = err.http_status, type(err).__name__
    if status == 503:
        return _busy(name, str(err))
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return error_response(status, name, str(err), headers)


def database_error(request: Request, err: Exception) -> JSONResponse:
    log.error("%s %s: unclassified database error", request.method, request.url.path, exc_info=err)
    return _busy("StoreError", "the pool store failed; the server logged it")


def validation_error(request: Request, err: Exception) -> JSONResponse:
    assert isinstance(err, RequestValidationError)
    issues = [
        {
            "loc": [p if isinstance(p, int) else str(p) for p in e.get("loc", ())],
            "msg": str(e.get("msg", "")),
            "type": str(e.get("type", "")),
        }
        for e in err.errors()
    ]  # never the offending input itself: it may be large, and is the client's anyway
    sent = request.headers.get("content-type", "")
    if sent and sent.split(";")[0].strip().lower() != "application/json":  # FastAPI read no JSON: say why
        for issue in issues:
            if issue["loc"] == ["body"]:
                issue["msg"] = f"a JSON body needs Content-Type: application/json, not {sent[:80]}"
    return error_response(422, "ValidationError", issues)


def http_error(_: Request, err: Exception) -> JSONResponse:
    assert isinstance(err, HTTPException)
    if err.status_code == 400:  # FastAPI could not even decode the body (not UTF-8): a validation error
        return error_response(
            422, "ValidationError", [{"loc": ["body"], "msg": str(err.detail), "type": "body"}]
        )
    names = {404: "NotFound", 405: "MethodNotAllowed"}
    return error_response(
        err.status_code, names.get(err.status_code, "HTTPError"), str(err.detail), dict(err.headers or {})
    )


def unexpected(_: Request, err: Exception) -> JSONResponse:
    # Starlette's outermost middleware answers with this, then re-raises: uvicorn logs the traceback.
    return error_response(500, "InternalError", "unexpected server error; the server logged it")


def install(app: FastAPI) -> None:
    app.add_exception_handler(PoolError, pool_error)
    app.add_exception_handler(SQLAlchemyError, database_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)
