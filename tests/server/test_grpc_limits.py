"""--grpc-max-recv-msg-size: upstream's size syntax, and the limit on the ext_proc port (RESOURCE_EXHAUSTED past it)."""

from __future__ import annotations

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from epp.datalayer.static import parse_endpoints
from epp.server.cli import parse_size, settings_from_args
from epp.server.flags import FlagError
from epp.server.server import EndpointPicker
from tests.extproc.test_processor import POST, Conversation, Mode, body, destination, headers
from tests.pickers import loopback_settings


@pytest.mark.parametrize(
    ("text", "size"),
    [("10MiB", 10 << 20), ("25MB", 25_000_000), ("4Mi", 4 << 20), ("1e6", 1_000_000), ("2.5e1", 25),
     ("1048576", 1 << 20), ("1.5Gi", 3 << 29), ("10k", 10_000), ("", 0), ("0", 0), (" 64Ki ", 65536)],
)  # fmt: skip
def test_sizes_are_read_as_upstream_reads_them(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize(("text", "message"), [("1.5", "not a whole number of bytes"), ("ten", "is not a size")])
def test_a_bad_size_is_named(text: str, message: str) -> None:
    with pytest.raises(FlagError, match=f"invalid grpc-max-recv-msg-size: .*{message}"):
        settings_from_args([f"--grpc-max-recv-msg-size={text}"])


async def test_a_message_past_the_limit_fails_its_stream_only() -> None:
    settings, not_yet = settings_from_args(["--grpc-max-recv-msg-size=2KiB"])
    assert settings.grpc_max_recv_message == 2048 and "grpc-max-recv-msg-size" not in not_yet
    picker = EndpointPicker(
        loopback_settings(
            endpoints=tuple(parse_endpoints("127.0.0.1:9")),
            scrape_metrics=False,
            grpc_max_recv_message=settings.grpc_max_recv_message,
        )
    )
    await picker.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{picker.grpc_port}") as channel:
            stub = pb_grpc.ExternalProcessorStub(channel)
            big = Conversation(stub)  # BUFFERED: the whole body in one message, 3 KB
            await big.send(headers(POST, mode=Mode.BUFFERED))
            await big.read()  # (the headers' continue)
            await big.send(body(b'{"model": "m", "prompt": "' + b"x" * 3000 + b'"}', end_of_stream=True))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await big.read()
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            small = Conversation(stub)  # the connection, and the next stream, go on
            await small.send(headers({":method": "GET", ":path": "/v1/models"}, end_of_stream=True))
            assert destination(await small.read()) == "127.0.0.1:9"
            small.call.cancel()
    finally:
        await picker.stop(0)
