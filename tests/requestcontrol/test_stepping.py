from __future__ import annotations

import asyncio

import pytest

from epp.requestcontrol.stepping import _Carried, start


async def test_a_coroutine_that_does_not_wait_runs_to_its_end_here_with_no_task() -> None:
    done: list[str] = []

    async def route() -> None:
        done.append("routed")

    before = len(asyncio.all_tasks())
    assert start(route()) is None
    assert done == ["routed"]  # in the caller's frame, before anything else ran
    assert len(asyncio.all_tasks()) == before


async def test_awaiting_what_is_already_done_does_not_wait() -> None:
    future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    future.set_result(7)
    got: list[int] = []

    async def route() -> None:
        got.append(await future)

    assert start(route()) is None
    assert got == [7]


async def test_a_coroutine_that_waits_is_carried_on_by_a_task_with_what_it_waited_for() -> None:
    loop = asyncio.get_running_loop()
    first: asyncio.Future[int] = loop.create_future()
    second: asyncio.Future[str] = loop.create_future()
    steps: list[object] = []

    async def route() -> None:
        steps.append("started")
        steps.append(await first)
        steps.append(await second)  # a second wait, inside the task
        steps.append("ended")

    task = start(route())
    assert isinstance(task, asyncio.Task)
    assert steps == ["started"]
    first.set_result(1)
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert steps == ["started", 1]
    second.set_result("two")
    await task
    assert steps == ["started", 1, "two", "ended"]


async def test_an_exception_from_what_it_waited_for_is_raised_in_the_coroutine() -> None:
    future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    caught: list[BaseException] = []

    async def route() -> None:
        try:
            await future
        except LookupError as exc:
            caught.append(exc)

    task = start(route())
    assert task is not None
    future.set_exception(KeyError("gone"))
    await task
    assert [type(exc) for exc in caught] == [KeyError]


@pytest.mark.parametrize("at_once", [False, True], ids=["waiting", "before-the-first-step"])
async def test_cancelling_the_task_is_a_cancellation_inside_the_coroutine(at_once: bool) -> None:
    # What an admission wait relies on: the request leaves the queue when its stream goes away. The
    # owner cancels a worker's route as soon as its Cancel is read, which may be in the same read as
    # its Route: before the task has run at all; the route must see that too, not be left suspended
    # until it is garbage.
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    seen: list[str] = []

    async def route() -> None:
        try:
            await future
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise
        finally:
            seen.append("cleaned up")

    task = start(route())
    assert task is not None
    if not at_once:
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == ["cancelled", "cleaned up"]
    # a task that waited on the future cancels it too, as a task's own coroutine's
    assert future.cancelled() is not at_once


async def test_a_coroutine_that_handles_its_cancellation_ends_its_task_normally() -> None:
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def route() -> None:
        try:
            await future
        except asyncio.CancelledError:
            return  # (the processor's route: the stream's end is handled there)

    task = start(route())
    assert task is not None
    await asyncio.sleep(0)
    task.cancel()
    await task
    assert not task.cancelled()


async def test_an_exception_in_the_first_step_is_raised_to_the_caller() -> None:
    async def route() -> None:
        raise ValueError("bad")

    with pytest.raises(ValueError, match="bad"):
        start(route())


async def test_closing_what_carries_it_on_closes_the_coroutine() -> None:
    # A task destroyed unfinished (its loop closed, say) closes its coroutine: the route's own must
    # be closed with it, so that its ``finally`` (leaving a queue, finishing a pick) runs.
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    closed: list[str] = []

    async def route() -> None:
        try:
            await future
        finally:
            closed.append("closed")

    coroutine = route()
    waiting_on = coroutine.send(None)
    carrier = _Carried(coroutine, waiting_on)
    assert carrier.send(None) is future  # what the task would wait on
    carrier.close()
    assert closed == ["closed"]


async def test_a_bare_yield_to_the_loop_goes_on_in_the_task() -> None:
    # asyncio.sleep(0) yields None, not a future: the task's first step resumes the coroutine.
    steps: list[str] = []

    async def route() -> None:
        steps.append("before")
        await asyncio.sleep(0)
        steps.append("after")

    task = start(route())
    assert task is not None and steps == ["before"]
    await task
    assert steps == ["before", "after"]
