"""``POST /v1/board-events``: any board tells the pool that tasks turned ready (docs/design.md, "Events").

A board the pool reaches over HTTP, or a third party's behind an entry point, writes its tasks
where the plane cannot see them happen; it calls this (with the board token, ``poolctl token
--board``) when a task is added or made ready, and a dispatch is sent at once instead of at
the next tick. The call is a hint: it names no task and changes nothing by itself, a lost or
repeated one costs at most a tick or a dispatch that finds nothing, and beat still dispatches
at every tick whatever boards say.
"""

# No ``from __future__ import annotations``: FastAPI reads the endpoints' annotations.
from typing import Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from poolkeeper.api.deps import AuthFirst, BoardCaller, PlaneEvents
from poolkeeper.events import task_ready
from poolkeeper.http.errors import refusals

router = APIRouter(prefix="/v1", tags=["board events"], responses=refusals(403), route_class=AuthFirst)


class BoardEvent(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    event: Literal["ready"] = Field(description="Tasks turned ready (added, unblocked or requeued).")


class Noted(BaseModel):
    outcome: Literal["dispatch_asked"]


@router.post("/board-events", response_model=Noted)
def board_event(body: BoardEvent, _: BoardCaller, events: PlaneEvents) -> Noted:
    """Ask for a dispatch now: the board has ready tasks."""
    task_ready(events)
    return Noted(outcome="dispatch_asked")
