"""``--io-thread`` reaches the ext_proc server, in one process and in each worker's spec."""

from __future__ import annotations

import pytest

from epp.datalayer.static import parse_endpoints
from epp.server.server import EndpointPicker
from tests.pickers import loopback_settings


@pytest.mark.parametrize("io_thread", [True, False])
async def test_the_flag_reaches_the_ext_proc_server_and_the_workers(io_thread: bool) -> None:
    settings = loopback_settings(
        endpoints=tuple(parse_endpoints("10.0.0.1:8000")), scrape_metrics=False, io_thread=io_thread
    )
    picker = EndpointPicker(settings)
    await picker.start()
    try:
        assert picker._server is not None and picker._server._io_thread is io_thread
        assert picker._health_server._io_thread is False  # health streams never echo
        assert picker._worker_spec(0).io_thread is io_thread
    finally:
        await picker.stop(0)
