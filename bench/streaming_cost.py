"""What streamed responses cost the picker and Envoy: CPU per request and per SSE chunk, side by side.

Long streamed outputs are what LLM traffic is, and with the reference configuration (response body
FULL_DUPLEX_STREAMED, as upstream and the gateways that implement InferencePool configure it) every
SSE event is one ext_proc message each way. This bench measures that cost through a real Envoy:

* ``direct``: Envoy alone, round robin to echo backends (no ext_proc);
* ``epp``:    Envoy with the reference ext_proc configuration calling the picker;
* ``base``:   the same with another tree's picker (``--baseline-python``: that tree's virtualenv's
  python), to compare two versions side by side in one run.
* ``none``:   (``--none``) this tree's picker behind an Envoy with response body mode NONE: the
  picker sees the response headers and the stream's end, no chunk (and so no usage tokens).
* ``observe``: (``--observe``) this tree's picker behind an Envoy that observes responses
  (``epp envoy-config --observe-responses``): the picker's filter skips the response, a second
  one in Envoy's observability mode sends it the response's headers, chunks and end, answered by
  nothing;
* ``tls``:    (``--tls``) this tree's picker serving TLS (``--secure-serving=true``, upstream's
  default, its self-signed certificate) to an Envoy that connects to it over TLS; and beside it
  ``tls-uv``, the same with ``--native-tls=false`` (the event loop's TLS instead of C's).

The echo backends (:mod:`epp.testing.backends`) answer ``"stream": true`` with ``max_tokens`` SSE
events, ``--token-interval`` seconds apart (default 2 ms, so that Envoy forwards events one by one,
as a decoding engine's are). For each number of events and each concurrency (``--streams``: 1 stream
at a time, then 16 at once), both modes run the same requests, alternating for ``--rounds`` rounds;
the table gives medians of: the picker's CPU ms per request, µs per SSE chunk and µs per ext_proc message it answered
(from ``/proc``, user + system, worker processes included) and the kernel's share of it (system over
user + system in the run: at one stream most of a chunk's cost is the kernel's, the wake-up, the
syscalls and, on loopback, the TCP work of Envoy's side that the picker's sends run), Envoy's CPU ms
per request in both modes, and the ext_proc messages per request (Envoy's own ``ext_proc`` stream
counters). The picker's CPU is counted above its idle rate (measured for ``--idle-seconds`` before
the load: scraping the pods, timers), which would otherwise be charged to the messages of slow
streams. A 1 KB prompt by default; ``--prompt-bytes 409600`` for the 400 KB case.

    python bench/streaming_cost.py [--events 16,256,1024] [--streams 1,16] [--requests 20] [--rounds 3]
                                   [--prompt-bytes 1024] [--baseline-python /other/tree/.venv/bin/python]

Talks only to 127.0.0.1; stops by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from urllib.request import urlopen

import aiohttp

from epp.envoy.bootstrap import BootstrapOptions, render, render_round_robin
from epp.testing.envoy import EnvoyProcess
from epp.testing.harness import PickerProcess, cpu_seconds, cpu_times, wait_for_picker


@dataclass
class Run:
    mode: str
    events: int
    streams: int
    requests: int
    picker_cpu_ms: float | None  # per request, above the picker's idle rate
    envoy_cpu_ms: float  # per request
    messages: float | None  # ext_proc messages the picker answered, per request
    kernel_share: float | None  # the picker's system CPU over its user + system CPU in the run (idle included)
    chunks: float  # SSE data lines the client received, per request
    errors: int


def _envoy_messages(envoy: EnvoyProcess) -> int:
    """ext_proc messages Envoy received from the picker so far (its filter's stream counters)."""
    with urlopen(f"http://127.0.0.1:{envoy.admin_port}/stats?format=json&filter=ext_proc", timeout=5) as answer:
        stats = json.load(answer)["stats"]
    return sum(int(s.get("value", 0)) for s in stats if s.get("name", "").endswith("ext_proc.stream_msgs_received"))


async def _one(session: aiohttp.ClientSession, url: str, body: bytes) -> tuple[int, int]:
    """(status, SSE data lines) of one streamed request, read to its end."""
    async with session.post(url, data=body, headers={"content-type": "application/json"}) as response:
        lines = 0
        async for line in response.content:
            if line.startswith(b"data:"):
                lines += 1
        return response.status, lines


async def _load(url: str, body: bytes, requests: int, streams: int) -> tuple[int, int]:
    """Send ``requests`` streamed requests, ``streams`` at a time; (errors, SSE lines received)."""
    errors = lines = 0
    queue = list(range(requests))
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def worker() -> None:
            nonlocal errors, lines
            while queue:
                queue.pop()
                status, got = await _one(session, url, body)
                errors += status != 200
                lines += got

        await asyncio.gather(*(worker() for _ in range(streams)))
    return errors, lines


def _idle_rate(pid: int, seconds: float) -> float:
    """The picker's CPU seconds per second with no traffic: its scrapes, timers and health checks."""
    before, start = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return (cpu_seconds(pid) - before) / (time.monotonic() - start)


def _measure(
    mode: str,
    envoy: EnvoyProcess,
    picker_pid: int | None,
    body: bytes,
    events: int,
    streams: int,
    requests: int,
    idle: float = 0.0,
) -> Run:
    url = f"http://127.0.0.1:{envoy.listen_port}/v1/completions"
    picker_before = cpu_times(picker_pid) if picker_pid else (0.0, 0.0)
    envoy_before = cpu_seconds(envoy.pid, children=False)
    messages_before = _envoy_messages(envoy) if picker_pid else 0
    start = time.monotonic()
    errors, lines = asyncio.run(_load(url, body, requests, streams))
    elapsed = time.monotonic() - start
    picker_after = cpu_times(picker_pid) if picker_pid else (0.0, 0.0)
    user, system = picker_after[0] - picker_before[0], picker_after[1] - picker_before[1]
    picker_used = user + system - idle * elapsed
    envoy_used = cpu_seconds(envoy.pid, children=False) - envoy_before
    messages = _envoy_messages(envoy) - messages_before if picker_pid else 0
    return Run(
        mode=mode,
        events=events,
        streams=streams,
        requests=requests,
        picker_cpu_ms=picker_used * 1e3 / requests if picker_pid else None,
        envoy_cpu_ms=envoy_used * 1e3 / requests,
        messages=messages / requests if picker_pid else None,
        kernel_share=system / (user + system) if picker_pid and user + system else None,
        chunks=lines / requests,
        errors=errors,
    )


def _print(runs: list[Run], args: argparse.Namespace) -> None:
    print(
        f"\nstreamed completions, {args.prompt_bytes} B prompt, events {args.token_interval * 1e3:g} ms apart; "
        f"{args.requests} requests per round, {args.rounds} rounds, medians\n"
    )
    header = (
        f"{'picker':>7} {'events':>6} {'streams':>7} | {'picker ms/req':>13} {'µs/chunk':>8} {'µs/message':>10} {'messages/req':>12} "
        f"{'kernel':>6} | "
        f"{'Envoy ms/req (epp)':>18} {'(direct)':>9} | {'SSE lines/req':>13} | errors"
    )
    print(header)
    print("-" * len(header))
    for mode in ("epp", "base", "none", "observe", "tls", "tls-uv"):
        for events in sorted({r.events for r in runs}):
            for streams in sorted({r.streams for r in runs}):
                picked = [r for r in runs if (r.events, r.streams, r.mode) == (events, streams, mode)]
                direct = [r for r in runs if (r.events, r.streams, r.mode) == (events, streams, "direct")]
                if not picked:
                    continue
                picker = statistics.median(r.picker_cpu_ms or 0.0 for r in picked)
                messages = statistics.median(r.messages or 0.0 for r in picked)
                per_message = statistics.median((r.picker_cpu_ms or 0.0) * 1e3 / (r.messages or 1.0) for r in picked)
                kernel = statistics.median(r.kernel_share or 0.0 for r in picked)
                per_chunk = statistics.median((r.picker_cpu_ms or 0.0) * 1e3 / (r.chunks or 1.0) for r in picked)
                print(
                    f"{mode:>7} {events:>6} {streams:>7} | {picker:13.2f} {per_chunk:8.1f} {per_message:10.1f} {messages:12.1f} "
                    f"{kernel:6.0%} | "
                    f"{statistics.median(r.envoy_cpu_ms for r in picked):18.2f} "
                    f"{statistics.median(r.envoy_cpu_ms for r in direct):9.2f} | "
                    f"{statistics.median(r.chunks for r in picked):13.1f} | {sum(r.errors for r in picked + direct)}"
                )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", default="16,256,1024", help="SSE events per response, comma-separated")
    parser.add_argument("--streams", default="1,16", help="concurrent streams, comma-separated")
    parser.add_argument("--requests", type=int, default=20, help="requests per round and case")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-bytes", type=int, default=1024)
    parser.add_argument("--token-interval", type=float, default=0.002, help="seconds between SSE events")
    parser.add_argument("--baseline-python", help="another tree's python: its picker runs beside this one (mode base)")
    parser.add_argument(
        "--picker-arg", action="append", default=[], help="an extra flag for both pickers (e.g. --scrape-metrics=false)"
    )
    parser.add_argument("--idle-seconds", type=float, default=5.0, help="how long each picker's idle rate is measured")
    parser.add_argument(
        "--none", action="store_true",
        help="also mode 'none': this tree's picker behind an Envoy whose response body mode is NONE",
    )  # fmt: skip
    parser.add_argument(
        "--observe", action="store_true",
        help="also mode 'observe': this tree's picker behind an Envoy that observes responses (--observe-responses)",
    )  # fmt: skip
    parser.add_argument(
        "--tls", action="store_true",
        help="also modes 'tls' and 'tls-uv': this tree's picker serving TLS (--secure-serving=true) to an Envoy "
        "that uses it, in C and (tls-uv) with the event loop's TLS",
    )  # fmt: skip
    args = parser.parse_args(argv)

    backends = subprocess.Popen(
        [sys.executable, "-m", "epp.testing.backends", "--count", "2", "--token-interval", str(args.token_interval)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert backends.stdout is not None
    pool = [backends.stdout.readline().split()[1] for _ in range(2)]
    pickers = {"epp": PickerProcess(pool, extra_args=args.picker_arg)}
    if args.baseline_python:
        pickers["base"] = PickerProcess(pool, python=args.baseline_python, extra_args=args.picker_arg)
    if args.none:
        pickers["none"] = PickerProcess(pool, extra_args=args.picker_arg)
    if args.observe:
        pickers["observe"] = PickerProcess(pool, extra_args=args.picker_arg)
    if args.tls:
        pickers["tls"] = PickerProcess(pool, tls=True, extra_args=args.picker_arg)
        pickers["tls-uv"] = PickerProcess(pool, tls=True, extra_args=[*args.picker_arg, "--native-tls=false"])
    envoys: dict[str, EnvoyProcess] = {}
    runs: list[Run] = []
    try:
        base = BootstrapOptions(listen_address="127.0.0.1", listen_port=0, admin_port=0, pool_endpoints=tuple(pool))
        envoys["direct"] = EnvoyProcess(render_round_robin(base), concurrency=1)
        for mode, picker in pickers.items():
            picker.start(timeout=120)  # a shared, loaded machine can take more than the default 20 s
            body_mode = "NONE" if mode == "none" else base.response_body_mode
            options = replace(
                base,
                picker_port=picker.grpc_port,
                response_body_mode=body_mode,
                picker_tls=mode.startswith("tls"),
                observe_responses=mode == "observe",
            )
            envoys[mode] = EnvoyProcess(render(options), concurrency=1)
        for mode, envoy in envoys.items():
            envoy.start()
            if mode != "direct":
                wait_for_picker(envoy)
        idle = {mode: _idle_rate(picker.pid, args.idle_seconds) for mode, picker in pickers.items()}
        for mode, rate in idle.items():
            print(f"{mode}: idle {rate * 1e3:.1f} ms of CPU per second (subtracted from each run)", flush=True)
        prompt = ("the quick brown fox jumps over the lazy dog " * (args.prompt_bytes // 44 + 1))[: args.prompt_bytes]
        for events in (int(e) for e in args.events.split(",")):
            body = json.dumps({"model": "bench-model", "prompt": prompt, "max_tokens": events, "stream": True}).encode()
            for streams in (int(s) for s in args.streams.split(",")):
                for mode, picker in pickers.items():  # warm-up
                    _measure(mode, envoys[mode], picker.pid, body, events, streams, max(2, streams))
                for _ in range(args.rounds):
                    runs.append(_measure("direct", envoys["direct"], None, body, events, streams, args.requests))
                    for mode, picker in pickers.items():
                        runs.append(
                            _measure(mode, envoys[mode], picker.pid, body, events, streams, args.requests, idle[mode])
                        )
                    time.sleep(0.2)
    finally:
        for envoy in envoys.values():
            envoy.stop()
        for picker in pickers.values():
            picker.stop()
        backends.terminate()
        backends.wait(10)
    _print(runs, args)
    return 1 if any(r.errors for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
