"""Echo model servers: the simplest honest upstreams for protocol tests and overhead benchmarks.

Each :class:`EchoServer` answers every request (but ``GET /metrics`` and ``/metrics/``, a minimal vLLM page
for the picker's scraper) with JSON that proves what it received (its own
name and port, the body's length and SHA-256, the headers) and records it, so a test can assert
that a request reached the endpoint the picker chose with its body byte-identical. A body with
``"stream": true`` is answered as an OpenAI-style SSE stream of ``max_tokens`` events spaced
``token_interval`` seconds apart, flushed one by one, so a test can see a proxy stream them through.

For routing behaviour (queues, KV-cache, LoRA, prefix caching) use the vLLM simulator in
:mod:`epp.sim` instead; these servers model nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import signal
import sys
from dataclasses import dataclass, field

from aiohttp import web

__all__ = ["EchoServer", "Received", "start_echo_servers"]


@dataclass(frozen=True, slots=True)
class Received:
    method: str
    path: str
    headers: dict[str, str]
    body_len: int
    body_sha256: str


@dataclass
class EchoServer:
    name: str
    host: str = "127.0.0.1"
    port: int = 0
    token_interval: float = 0.05
    received: list[Received] = field(default_factory=list)
    _runner: web.AppRunner | None = None

    @property
    def hostport(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> None:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if request.path in ("/metrics", "/metrics/") and request.method == "GET":  # vLLM serves both
            # Enough of a vLLM page for the picker's scraper; not recorded as a received request.
            return web.Response(body=_METRICS_PAGE, content_type="text/plain")
        if request.headers.get("User-Agent") == "epp-model-poller":
            # The picker's model poller: no model list (the pod stays "unknown"), not a received request.
            return web.Response(status=404)
        try:
            body = await request.read()
        except ConnectionResetError:  # the client left mid-upload (a load generator stopping)
            return web.Response(status=499)
        seen = Received(
            method=request.method,
            path=request.path_qs,
            headers={k.lower(): v for k, v in request.headers.items()},
            body_len=len(body),
            body_sha256=hashlib.sha256(body).hexdigest(),
        )
        self.received.append(seen)
        answer = {
            "backend": self.name,
            "port": self.port,
            "method": seen.method,
            "path": seen.path,
            "body_len": seen.body_len,
            "body_sha256": seen.body_sha256,
            "headers": seen.headers,
        }
        headers = {"x-backend-name": self.name}
        stream, tokens = _stream_request(body)
        if not stream:
            return web.json_response(answer, headers=headers)
        response = web.StreamResponse(
            headers={**headers, "content-type": "text/event-stream", "cache-control": "no-cache"}
        )
        await response.prepare(request)
        for index in range(tokens):
            chunk = {
                "object": "text_completion",
                "backend": self.name,
                "index": index,
                "choices": [{"text": f"t{index} "}],
            }
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(self.token_interval)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


_METRICS_PAGE = b"""# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="echo"} 0.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="echo"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="echo"} 0.0
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="0",running_lora_adapters="",waiting_lora_adapters=""} 1.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="1048576"} 1.0
"""


def _stream_request(body: bytes) -> tuple[bool, int]:
    if b'"stream"' not in body:
        return False, 0
    try:
        parsed = json.loads(body)
    except ValueError:
        return False, 0
    if not isinstance(parsed, dict) or parsed.get("stream") is not True:
        return False, 0
    tokens = parsed.get("max_tokens", 5)
    return True, tokens if isinstance(tokens, int) and 0 < tokens <= 10_000 else 5


async def start_echo_servers(count: int, *, host: str = "127.0.0.1", token_interval: float = 0.05) -> list[EchoServer]:
    servers = [EchoServer(name=f"echo-{i}", host=host, token_interval=token_interval) for i in range(count)]
    for server in servers:
        await server.start()
    return servers


async def _main(count: int, token_interval: float) -> None:
    servers = await start_echo_servers(count, token_interval=token_interval)
    for server in servers:
        print(f"{server.name} {server.hostport}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for server in servers:
        await server.stop()


def main(argv: list[str] | None = None) -> int:
    """``python -m epp.testing.backends --count N``: print ``name ip:port`` per server, serve until SIGTERM."""
    parser = argparse.ArgumentParser(prog="python -m epp.testing.backends", description=main.__doc__)
    parser.add_argument("--count", type=int, default=2)
    parser.add_argument("--token-interval", type=float, default=0.05)
    args = parser.parse_args(argv)
    try:
        import uvloop

        uvloop.run(_main(args.count, args.token_interval))
    except ImportError:
        asyncio.run(_main(args.count, args.token_interval))
    return 0


if __name__ == "__main__":
    sys.exit(main())
