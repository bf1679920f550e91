"""epp.wire's socket tests (test_server.py) run on both event loops: the picker serves on uvloop, the
rest of the suite runs on asyncio's."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import pytest

LoopFactory = Callable[[], asyncio.AbstractEventLoop]


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> Mapping[str, LoopFactory]:
    factories: dict[str, LoopFactory] = {"asyncio": asyncio.new_event_loop}
    if item.path.name not in ("test_server.py", "test_io_thread.py", "test_tls.py"):
        return factories
    try:
        import uvloop
    except ImportError:  # no uvloop on this platform: asyncio's loop only
        return factories
    factories["uvloop"] = uvloop.new_event_loop
    return factories
