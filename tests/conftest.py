"""Fixtures shared across test packages: a fake Kubernetes API server on 127.0.0.1 and a kubeconfig pointing at it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from epp.testing.fake_apiserver import FakeApiServer

TOKEN = "test-token"


@pytest.fixture
async def api() -> AsyncIterator[FakeApiServer]:
    server = FakeApiServer(token=TOKEN, bookmark_interval=0.1)
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
def kubeconfig(api: FakeApiServer, tmp_path: Path) -> Path:
    return api.kubeconfig(tmp_path / "kubeconfig")


async def eventually(predicate: Callable[[], object], what: str, timeout: float = 10.0) -> None:
    """Wait until ``predicate()`` is true; fail naming ``what`` if it is not within ``timeout``.

    A bounded wait for a condition the code under test must reach, not a measurement: on a loaded
    machine it only takes longer.
    """
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        await asyncio.sleep(0.02)
