"""``epp demo``: the whole request path on one machine, in one command.

Starts, all on 127.0.0.1:

1. a simulated vLLM pool (:mod:`epp.sim`, one process, ``--pods`` pods);
2. the picker (``epp serve`` as a child process, static pool = the simulated pods);
3. a real Envoy (``deploy/envoy``'s configuration, rendered for these ports) on ``--port``;

then sends a handful of OpenAI requests through Envoy and prints which pod served each, with its
latency; then shows the prefix effect: streamed chat requests of two prompt families (each a long
system prompt with different questions), with the pod that served each, its time to first token and
how much of its prompt that pod found in its KV-cache (the simulator's ``x-sim-prefix-hit-tokens``).
The first request of a family computes its whole prompt; the picker remembers where it sent the
prompt's blocks and sends the rest of the family to the same pod, whose cache already holds them,
so their first token comes several times sooner. Everything keeps running for you to try (``curl``)
until Ctrl-C or SIGTERM, unless ``--once``.

It says what it shows: the simulated pods' speed-up over a real GPU (``--time-scale``) and a legend
of the terms in its tables (TTFT, SSE, KV-cache). Stopping, by Ctrl-C, SIGTERM or ``--once``, stops
Envoy, the picker (and its scrape worker) and the simulator and removes the temporary files. A
listener port already in use (another demo running) stops it before anything starts: with
SO_REUSEPORT off in the bootstrap, a second Envoy could not share the port anyway.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

import aiohttp

from epp.envoy.bootstrap import BootstrapOptions, render
from epp.testing.envoy import EnvoyError, EnvoyProcess
from epp.testing.harness import PickerProcess, wait_for_picker

__all__ = ["main"]

_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
_LEGEND = """\
  TTFT      time to first token: how long a client waits before the first word of the answer
  SSE       server-sent events: a streamed answer, one "data:" event per chunk of tokens
  KV-cache  the attention state a pod keeps for prompts it has processed; a new prompt that starts
            the same way reuses it and skips that part of the prefill (computing the prompt)"""
_SYSTEM = "You are a concise assistant for a bicycle repair shop. " * 12


def _requests() -> list[tuple[str, str, str, dict | bytes | None]]:
    """(label, method, path, body) of the demo requests."""
    chat = lambda question: {  # noqa: E731
        "model": _MODEL,
        "messages": [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": 24,
    }
    return [
        ("list models", "GET", "/v1/models", None),
        (
            "completion",
            "POST",
            "/v1/completions",
            {"model": _MODEL, "prompt": "The capital of France is", "max_tokens": 16},
        ),
        ("chat", "POST", "/v1/chat/completions", chat("How do I fix a flat tyre?")),
        ("chat, same system prompt", "POST", "/v1/chat/completions", chat("How tight should brake cables be?")),
        ("chat, streamed", "POST", "/v1/chat/completions", {**chat("What oil for a chain?"), "stream": True}),
        ("completion", "POST", "/v1/completions", {"model": _MODEL, "prompt": "Once upon a time", "max_tokens": 16}),
        ("bad request: not JSON", "POST", "/v1/completions", b'{"model": "' + _MODEL.encode() + b'", "prompt": '),
    ]


async def _send(
    session: aiohttp.ClientSession, url: str, method: str, path: str, body: dict | bytes | None
) -> tuple[int, str, float, str]:
    started = time.perf_counter()
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    async with session.request(method, url + path, data=data, headers={"content-type": "application/json"}) as response:
        text = await response.text()
        elapsed = time.perf_counter() - started
        # No pod answered: the picker did (the pool's model list, its own 400s).
        pod = response.headers.get("x-sim-pod", "picker")
        detail = ""
        if response.status >= 400:
            try:
                detail = json.loads(text)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                detail = text.strip()[:80]
        elif "text/event-stream" in response.headers.get("content-type", ""):
            detail = f"{text.count('data: ')} SSE events"
        return response.status, pod, elapsed, detail


# Two prompt families: a long system prompt each (about 6,000 tokens at 4 characters per token, so its
# prefill is long enough to see: ~0.24 s on the simulated GPU), then a short question.
_FAMILY_TOKENS = 6000
_FAMILIES = {
    "bicycle shop": (
        "You are the service desk of a bicycle repair shop.",
        (
            "Quote prices for parts and labour separately.",
            "Never promise a repair by a fixed date.",
            "Suggest a safety check for any bicycle older than five years.",
        ),
    ),
    "tax office": (
        "You are the help line of a municipal tax office.",
        (
            "Name the form a citizen needs before anything else.",
            "Do not give legal advice.",
            "Point out the filing deadline whenever a question mentions a year.",
        ),
    ),
}
_QUESTIONS = [
    ("bicycle shop", "How do I fix a flat tyre?"),
    ("bicycle shop", "How tight should brake cables be?"),
    ("tax office", "Which form declares income from renting a flat?"),
    ("bicycle shop", "What oil suits a chain in winter?"),
    ("tax office", "Can I pay the property tax in instalments?"),
    ("tax office", "Where do I send a change of address?"),
]


def _family_prompt(family: str) -> str:
    intro, rules = _FAMILIES[family]
    lines = [intro]
    i = 0
    while sum(len(line) + 1 for line in lines) < _FAMILY_TOKENS * 4:
        lines.append(f"Rule {i + 1}: {rules[i % len(rules)]}")
        i += 1
    return "\n".join(lines)


async def _first_token(
    session: aiohttp.ClientSession, url: str, family: str, question: str
) -> tuple[str, float, str, str]:
    """(pod, seconds to the first generated token, cached tokens, prompt tokens) of one streamed chat request."""
    body = {
        "model": _MODEL,
        "messages": [{"role": "system", "content": _family_prompt(family)}, {"role": "user", "content": question}],
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    ttft: float | None = None
    prompt_tokens = "?"
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        if response.status != 200:
            return f"status {response.status}", math.nan, "-", "-"
        # No pod answered: the picker did (the pool's model list, its own 400s).
        pod = response.headers.get("x-sim-pod", "picker")
        cached = response.headers.get("x-sim-prefix-hit-tokens", "?")
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if ttft is None and any(c.get("delta", {}).get("content") for c in chunk.get("choices", ())):
                ttft = time.perf_counter() - started  # the role chunk carries no token: skip it
            if chunk.get("usage"):
                prompt_tokens = str(chunk["usage"]["prompt_tokens"])
    return pod, math.nan if ttft is None else ttft, cached, prompt_tokens


async def _prefix_effect(url: str) -> None:
    print(
        f"\nThe prefix effect: two prompt families, each a ~{_FAMILY_TOKENS:,}-token system prompt with different"
        "\nquestions, streamed one at a time. The first of a family computes its whole prompt; the picker"
        "\nsends the rest to the pod that already holds that prefix in its KV-cache:\n"
    )
    print(f"  {'family':<13} {'question':<50} {'served by':<10} {'TTFT':>7}  cached/prompt tokens")
    seen: dict[str, list[tuple[str, float]]] = {}
    async with aiohttp.ClientSession() as session:
        for family, question in _QUESTIONS:
            pod, ttft, cached, prompt = await _first_token(session, url, family, question)
            seen.setdefault(family, []).append((pod, ttft))
            print(f"  {family:<13} {question:<50} {pod:<10} {ttft * 1000:5.0f}ms  {cached}/{prompt}")
    print()
    for family, served in seen.items():
        (first_pod, first), rest = served[0], served[1:]
        later = [t for _, t in rest]
        same = sum(pod == first_pod for pod, _ in rest)
        median = statistics.median(later) if later else math.nan
        print(
            f"  {family}: first request {first * 1000:.0f}ms on {first_pod}; {same} of the next {len(rest)} on "
            f"{first_pod} too, median {median * 1000:.0f}ms ({first / median:.0f}x sooner)"
        )


async def _drive(url: str) -> None:
    print(f"\nSending requests to Envoy at {url}:\n")
    print(_LEGEND + "\n")
    print(f"  {'request':<26} {'status':>6}  {'served by':<10} {'latency':>8}  note")
    async with aiohttp.ClientSession() as session:
        for label, method, path, body in _requests():
            status, pod, elapsed, detail = await _send(session, url, method, path, body)
            print(f"  {label:<26} {status:>6}  {pod:<10} {elapsed * 1000:6.0f}ms  {detail}")


def _port_in_use(port: int) -> bool:
    """Whether 127.0.0.1:``port`` is taken (bound without SO_REUSEPORT, as the bootstrap's listener is)."""
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def _stop_on_sigterm(signum: int, frame: object) -> None:
    # SystemExit unwinds main()'s `finally`, which stops every child; the default action would not.
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="epp demo", description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=3, help="simulated vLLM pods")
    parser.add_argument("--port", type=int, default=8081, help="Envoy's listener on 127.0.0.1 (0: any free port)")
    parser.add_argument(
        "--time-scale",
        type=float,
        default=0.2,
        help="wall seconds per simulated second (0.2 = 5x faster than a real GPU)",
    )
    parser.add_argument("--once", action="store_true", help="send the requests, then stop everything")
    args = parser.parse_args(argv)
    if args.port and _port_in_use(args.port):
        print(
            f"epp demo: 127.0.0.1:{args.port} is in use (another epp demo?): stop it, "
            "or give --port PORT (0: any free port)",
            file=sys.stderr,
        )
        return 1
    signal.signal(signal.SIGTERM, _stop_on_sigterm)

    sim = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "epp.sim",
            "--pods",
            str(args.pods),
            "--seed",
            "1",
            "--time-scale",
            str(args.time_scale),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    picker: PickerProcess | None = None
    envoy: EnvoyProcess | None = None
    try:
        assert sim.stdout is not None
        pods = [sim.stdout.readline().split()[1].removeprefix("http://") for _ in range(args.pods)]
        print(f"simulated vLLM pods: {', '.join(pods)}")
        print(
            f"  (simulated {1 / args.time_scale:g}x faster than real time on a GPU: --time-scale {args.time_scale:g}"
            " wall seconds per simulated second)"
        )
        picker = PickerProcess(pods)
        picker.start()
        print(
            f"picker: gRPC ext_proc on 127.0.0.1:{picker.grpc_port}, "
            f"metrics http://127.0.0.1:{picker.metrics_port}/metrics, log {picker.log_path}"
        )
        envoy = EnvoyProcess(
            render(
                BootstrapOptions(
                    listen_address="127.0.0.1", listen_port=args.port, admin_port=0, picker_port=picker.grpc_port
                )
            )
        )
        try:
            envoy.start()
        except EnvoyError as exc:
            print(f"epp demo: Envoy did not start on 127.0.0.1:{args.port}: {exc}", file=sys.stderr)
            return 1
        wait_for_picker(envoy)
        url = f"http://127.0.0.1:{envoy.listen_port}"
        print(f"Envoy: {url} (admin http://127.0.0.1:{envoy.admin_port})")
        asyncio.run(_drive(url))
        asyncio.run(_prefix_effect(url))
        if args.once:
            return 0
        print(
            f"\nEverything keeps running. Try:\n"
            f"  curl -s {url}/v1/completions -H 'content-type: application/json' \\\n"
            f'       -d \'{{"model": "{_MODEL}", "prompt": "Hello", "max_tokens": 8}}\'\n'
            "Ctrl-C stops the demo."
        )
        try:
            while sim.poll() is None and picker.process is not None and picker.process.poll() is None:
                time.sleep(0.5)
        except KeyboardInterrupt:
            print("\nstopping")
        return 0
    finally:
        if envoy is not None:
            envoy.stop()
        if picker is not None:
            picker.stop()  # removes its log file
        sim.terminate()
        sim.wait(10)
