"""A farm of cheap stand-in model servers: many ports, full-size vLLM /metrics pages, almost no CPU.

The scrape-cost benchmark needs 100 pods serving realistic ~55 KB vLLM metrics pages 20 times a
second each, on the same two cores as the picker it measures. Simulated pods (:mod:`epp.sim`) behind
aiohttp would spend more CPU serving those pages than the picker spends reading them, and that
noise would land on the measurement. Here each port is a bare ``asyncio.Protocol``: ``GET /metrics``
answers one of a few pre-rendered page variants (taken from a simulated pod that served real
traffic, then given different gauge values, so consecutive scrapes differ as they do on a busy
server; ``?name[]=`` restricts it to those samples, as prometheus_client does for vLLM), and any
other request gets a small JSON completion, so the farm can also be the pool
behind Envoy for request-path latency. ``--idle`` makes every pod serve one page, always the same:
an idle vLLM pod (nothing waiting or running) serves the same numbers scrape after scrape.

``python -m epp.testing.farm --pods 100`` prints ``pod-i ip:port`` lines and serves until SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import re
import signal
import sys
from urllib.parse import unquote_to_bytes

from epp.sim.exposition import restrict_page

__all__ = ["MetricsFarm", "idle_page", "realistic_pages"]

_COMPLETION = json.dumps(
    {"id": "cmpl-farm", "object": "text_completion", "choices": [{"index": 0, "text": " ok", "finish_reason": "stop"}],
     "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9}}
).encode()  # fmt: skip


async def _sample_page() -> bytes:
    """A /metrics page of a simulated vLLM pod after it served some traffic (histograms filled)."""
    import aiohttp

    from epp.sim import EngineConfig, SimulatedPool

    config = EngineConfig(
        time_scale=0.01,
        max_model_len=8192,
        num_gpu_blocks=8192,
        lora_adapters=("sql-lora", "chat-lora"),
        max_loras=2,
        seed=7,
    )
    async with SimulatedPool(1, config) as pool, aiohttp.ClientSession() as session:
        url = pool.url(0)
        bodies = [
            {"model": model, "prompt": f"request {i} " + "context " * (50 * (i % 7 + 1)), "max_tokens": 4 + i % 9}
            for i, model in zip(range(24), itertools.cycle([config.model, "sql-lora", "chat-lora"]))
        ]

        async def send(body: dict[str, object]) -> None:
            async with session.post(url + "/v1/completions", json=body) as response:
                await response.read()

        await asyncio.gather(*(send(body) for body in bodies))
        async with session.get(url + "/metrics") as response:
            return await response.read()


def realistic_pages(variants: int = 64, seed: int = 1) -> list[bytes]:
    """``variants`` full-size vLLM pages whose scheduler gauges vary as on a busy server.

    Each variant draws its waiting and running counts, its KV-cache usage (four decimals, like a
    real ratio) and the timestamp of the newest ``vllm:lora_requests_info`` series at random, so
    that consecutive scrapes of a pod rarely see the same page (a parser cannot coast on
    repeats that a loaded server would not give it).
    """
    import random

    page = asyncio.run(_sample_page())
    rng = random.Random(seed)
    newest = max(re.findall(rb"\nvllm:lora_requests_info\{[^}]*\} (\S+)", page), key=float, default=None)
    pages = []
    for _ in range(variants):
        varied = re.sub(rb"(\nvllm:num_requests_waiting\{[^}]*\}) \S+", rb"\1 %d.0" % rng.randint(0, 40), page)
        varied = re.sub(rb"(\nvllm:num_requests_running\{[^}]*\}) \S+", rb"\1 %d.0" % rng.randint(0, 64), varied)
        usage = rb"\1 %.4f" % rng.random()
        varied = re.sub(rb"(\nvllm:(?:kv|gpu)_cache_usage_perc\{[^}]*\}) \S+", usage, varied)
        if newest is not None:
            varied = varied.replace(b"} " + newest + b"\n", b"} %.7f\n" % (float(newest) + rng.random() * 100), 1)
        pages.append(varied)
    return pages


def idle_page(page: bytes) -> bytes:
    """``page`` (one of :func:`realistic_pages`) as an idle pod serves it: nothing waiting or running,
    no KV-cache block in use."""
    idle = re.sub(rb"(\nvllm:num_requests_(?:waiting|running)\{[^}]*\}) \S+", rb"\1 0.0", page)
    return re.sub(rb"(\nvllm:(?:kv|gpu)_cache_usage_perc\{[^}]*\}) \S+", rb"\1 0.0", idle)


def _http(page: bytes) -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: %d\r\n\r\n" % len(page) + page
    )


class _Pod(asyncio.Protocol):
    """One pod: its pages in turn for ``GET /metrics`` (restricted by ``name[]`` like
    prometheus_client), a small completion for anything else."""

    def __init__(self, pages: list[bytes], cache: dict[bytes, list[bytes]]) -> None:
        self._pages = pages
        self._turn = itertools.count()
        # Answers by request target, shared by all of the pod's connections: a reconnect must not
        # rebuild 64 filtered pages (~20 ms of CPU that feeds timeouts on a busy machine).
        self._cache = cache
        self._buffer = b""
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while True:
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self._buffer[:end]
            length = 0
            match = re.search(rb"(?i)\r\ncontent-length:\s*(\d+)", head)
            if match:
                length = int(match.group(1))
            if len(self._buffer) < end + 4 + length:
                return
            self._buffer = self._buffer[end + 4 + length :]
            assert self._transport is not None
            if head.startswith(b"GET /metrics"):
                target = head.split(b" ", 2)[1]
                responses = self._cache.get(target)
                if responses is None:
                    query = target.partition(b"?")[2]
                    names = {
                        unquote_to_bytes(v)
                        for k, _, v in (p.partition(b"=") for p in query.split(b"&"))
                        if k == b"name[]"
                    }
                    responses = [_http(restrict_page(p, names) if names else p) for p in self._pages]
                    self._cache[target] = responses
                self._transport.write(responses[next(self._turn) % len(responses)])
            else:
                self._transport.write(_COMPLETION_RESPONSE)


_COMPLETION_RESPONSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(_COMPLETION) + _COMPLETION
)


class MetricsFarm:
    """``pods`` listeners answering /metrics with ``pages`` in turn.

    With ``host_prefix`` (e.g. ``127.0.1.``) pod i listens on ``<prefix><i+1>:port`` - its own
    loopback address, the same port for every pod, as pods in a cluster have - so one process can
    serve the pods' metrics port and another their serving port.
    """

    def __init__(self, pods: int, pages: list[bytes], *, host_prefix: str | None = None, port: int = 0) -> None:
        if host_prefix is not None and not 0 < pods < 255:
            raise ValueError("one loopback address per pod: at most 254 pods")
        self.host_prefix = host_prefix
        self.port = port
        self.pods = pods
        self._pages = pages
        self._servers: list[asyncio.Server] = []
        self.hostports: list[str] = []

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        for i in range(self.pods):
            rotated = self._pages[i % len(self._pages) :] + self._pages[: i % len(self._pages)]
            host = "127.0.0.1" if self.host_prefix is None else f"{self.host_prefix}{i + 1}"
            # One answer cache per pod, shared by its connections (see _Pod).
            server = await loop.create_server(functools.partial(_Pod, rotated, {}), host, self.port)
            self._servers.append(server)
            self.hostports.append(f"{host}:{server.sockets[0].getsockname()[1]}")

    async def stop(self) -> None:
        for server in self._servers:
            server.close()
            await server.wait_closed()


async def _main(pods: int, host_prefix: str | None, port: int, idle: bool) -> None:
    pages = await asyncio.to_thread(realistic_pages)
    if idle:
        pages = [idle_page(pages[0])]
    farm = MetricsFarm(pods, pages, host_prefix=host_prefix, port=port)
    await farm.start()
    print(f"page-bytes {len(pages[0])}", flush=True)
    for i, hostport in enumerate(farm.hostports):
        print(f"pod-{i} {hostport}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await farm.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m epp.testing.farm", description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=100)
    parser.add_argument("--host-prefix", help="give pod i the loopback address PREFIX<i+1> (e.g. 127.0.1.)")
    parser.add_argument("--port", type=int, default=0, help="the port of every pod (with --host-prefix)")
    parser.add_argument("--idle", action="store_true", help="idle pods: each serves the same page every time")
    args = parser.parse_args(argv)
    try:
        import uvloop

        uvloop.run(_main(args.pods, args.host_prefix, args.port, args.idle))
    except ImportError:
        asyncio.run(_main(args.pods, args.host_prefix, args.port, args.idle))
    return 0


if __name__ == "__main__":
    sys.exit(main())
