"""The reflector's own parts; its list/watch behaviour against an API server is in test_discovery.py."""

import asyncio
import logging

import pytest

from epp.kube.reflector import Backoff, Reflector


def test_backoff_grows_and_is_bounded() -> None:
    backoff = Backoff(0.1, 2.0)
    delays = [backoff.next() for _ in range(30)]
    assert all(0 < d <= 2.0 for d in delays)
    assert max(delays[:2]) <= 0.2 < max(delays[-5:])  # it grows to the cap
    backoff.reset()
    assert backoff.next() <= 0.1


async def test_a_repeated_failure_is_one_warning_and_the_recovery_one_info(caplog: pytest.LogCaptureFixture) -> None:
    # A CRD that is not installed answers 404 to every list: one WARNING, not one every 30 s forever.
    answers = [404, 404, 404, 404, 200]
    listed = asyncio.Event()

    class _Response:
        def __init__(self, status: int) -> None:
            self.status = status

        async def read(self) -> bytes:
            if self.status == 200:
                listed.set()
                return b'{"metadata": {"resourceVersion": "1"}, "items": []}'
            return b'{"kind": "Status", "message": "the server could not find the requested resource"}'

        def release(self) -> None:
            pass

    async def list_call(**_: object) -> _Response:
        return _Response(answers.pop(0) if answers else 200)

    reflector = Reflector("inferenceobjectives", list_call, lambda: None, backoff=Backoff(0.001, 0.001))
    reflector._watch = lambda: asyncio.sleep(3600)  # type: ignore[method-assign]  # the list is what is tested
    with caplog.at_level(logging.DEBUG, logger="epp.kube.reflector"):
        task = asyncio.create_task(reflector.run())
        await asyncio.wait_for(listed.wait(), 5)
        await asyncio.sleep(0.01)
        task.cancel()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "404" in warnings[0].getMessage()
    assert sum(r.levelno == logging.DEBUG and "(again)" in r.getMessage() for r in caplog.records) == 3
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.INFO][-1].startswith(
        "inferenceobjectives: listed again after: 404"
    )
