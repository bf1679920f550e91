"""--emit-endpoint-scores through a running picker, one process and --workers (the owner's scores reach the worker)."""

from __future__ import annotations

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from epp.datalayer.static import parse_endpoints
from epp.server.cli import settings_from_args
from epp.server.server import EndpointPicker
from tests.extproc.test_processor import COMPLETION, POST, Conversation, _scores_of, body, destination, headers
from tests.pickers import loopback_settings


@pytest.mark.parametrize("workers", [0, 2], ids=["one-process", "workers"])
async def test_the_scores_reach_envoy(workers: int) -> None:
    settings, _ = settings_from_args(["--emit-endpoint-scores"])
    picker = EndpointPicker(
        loopback_settings(
            endpoints=tuple(parse_endpoints("127.0.0.1:9,127.0.0.2:9")),
            scrape_metrics=False,
            emit_endpoint_scores=settings.emit_endpoint_scores,
            workers=workers,
        )
    )
    await picker.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{picker.grpc_port}") as channel:
            talk = Conversation(pb_grpc.ExternalProcessorStub(channel))
            await talk.send(headers(POST))
            await talk.send(body(COMPLETION, end_of_stream=True))
            answer = await talk.read()
            scores = _scores_of(answer)
            assert scores is not None and set(scores) == {"127.0.0.1:9", "127.0.0.2:9"}
            assert destination(answer) in scores
            talk.call.cancel()
    finally:
        await picker.stop(0)
