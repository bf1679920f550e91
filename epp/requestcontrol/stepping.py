"""Routes started at once: a coroutine stepped by hand in the caller's turn, continued in a task only if it waits.

Design
------
A route usually never waits: with flow control off (upstream's default) or nothing queued, admission
lets it through in its first step, and the pick is plain computation. Run as a task, it would still
cost a task, a turn of the event loop before it starts, and its answers written outside the read that
brought the request (a write of their own). :func:`start` sends the coroutine its first ``None``
itself, in the caller's frame (the connection's read of the request, or the owner's read of a
worker's message): a route that does not wait finishes there, and its answers join the read's own
write. A route that does wait (a queue in admission, a tokenizer on a thread, a future another process
resolves) has yielded the future it waits on; :func:`start` hands the coroutine and that future to a
task, which waits on it and carries the coroutine on as its own would (:class:`_Carried`): its
outcome sent in, a cancellation thrown in (so an admission wait leaves its queue, even when the
cancel comes before the task first ran), and ``close`` on the coroutine if the task is destroyed
unfinished. Python 3.12's eager tasks do the same; this runs on 3.11.

What runs in the first step runs in the caller's context, not a copy of it, as a task's would: the
picker keeps nothing in context variables.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Generator
from typing import Any

__all__ = ["start"]


def start(coroutine: Coroutine[Any, Any, None]) -> asyncio.Task[None] | None:
    """Run ``coroutine`` to its first wait, here; None when it finished, else the task that carries it on.

    An exception it raises in that first step is raised here (the routes given to it catch their own).
    """
    try:
        waiting_on = coroutine.send(None)
    except StopIteration:
        return None
    return asyncio.get_running_loop().create_task(_Carried(coroutine, waiting_on))


class _Carried(Coroutine[Any, Any, None]):
    """The task's coroutine for a coroutine stepped by hand that yielded ``waiting_on`` (a future).

    Its first step hands the task that future; every later step, and every exception the task throws
    (its cancellation), goes to the coroutine itself, as it would in a task of its own. A cancel that
    comes before the task's first step too: an ``async def`` wrapper would be cancelled before it ran
    and leave the coroutine suspended (in admission's queue) until it was garbage.
    """

    __slots__ = ("_coroutine", "_waiting_on")

    def __init__(self, coroutine: Coroutine[Any, Any, None], waiting_on: Any) -> None:
        self._coroutine = coroutine
        self._waiting_on = waiting_on

    def send(self, value: Any) -> Any:
        waiting_on = self._waiting_on
        if waiting_on is not None:  # the task's first step: it waits on what the coroutine waits on
            self._waiting_on = None
            return waiting_on
        return self._coroutine.send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        self._waiting_on = None
        if val is None and tb is None:
            return self._coroutine.throw(typ)
        return self._coroutine.throw(typ, val, tb)  # (the old signature, deprecated: passed on as given)

    def close(self) -> None:
        self._waiting_on = None
        self._coroutine.close()

    def __await__(self) -> Generator[Any, Any, None]:
        raise TypeError("a task's coroutine: run by its task, never awaited")
