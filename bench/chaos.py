"""Chaos: mixed traffic through a real Envoy, the picker and simulated pods while faults are injected.

    python bench/chaos.py                      # 30 minutes, Envoy fail-open; prints a table, writes a PNG
    python bench/chaos.py --fail-closed        # the same with Envoy fail-closed
    python bench/chaos.py --minutes 5 --faults pod-kill,picker-kill --keep   # a subset; keep the evidence
    python bench/chaos.py --reanalyse DIR      # read a kept run again (after changing the analysis)

Exit status 1 when a request was lost or misrouted outside every fault's window (the table lists them).
Everything listens on loopback addresses (127.0.0.1, 127.0.42.x); load and run time are bounded.

What runs
---------
* Five simulated vLLM pods (``python -m epp.sim``), one process each so one can be SIGKILLed alone, each
  on its own loopback address and one shared port, as pods with their own IPs and an InferencePool's
  target port. Four are in the pool at the start, one is a standby; they serve the base model and some
  of two LoRA adapters (sim-0: sql-lora; sim-1: both; sim-2: chat-lora; sim-3: none; sim-4: both).
  Started with ``--fault-control`` and ``--record`` (:mod:`epp.sim.faults`): their metrics page can be
  broken on demand, and each appends one line per request it receives, with the request id, before
  serving it.
* The fake Kubernetes API server (:mod:`epp.testing.fake_apiserver`, in this process) holding the
  InferencePool and the pods; the picker runs in Kubernetes mode against it (``--pool-name`` and a
  kubeconfig), with defaults otherwise (50 ms scrapes, 2 s staleness, its scrape worker process).
* A real Envoy with the project's bootstrap (:mod:`epp.envoy.bootstrap`), fail-open by default (its
  round robin lists the three pods never taken out of the pool), plus an access log (route, upstream,
  response flags and details per request id): observation only.
* The load (this process): Poisson arrivals at ``--rate`` (30/s) of a mix: chat and completions,
  streamed or not, for the base model and each adapter, prompts that share 16 long document prefixes
  (the prefix-cache scorer has something to prefer) and unique ones, a body that is not JSON (the
  picker's 400) and ``GET /v1/models`` (the picker's own answer). Each request carries its
  ``x-request-id``; the client records its status and checks the answer is whole (a stream ends with
  ``[DONE]``).
* Samplers: the picker's and its scrape worker's and Envoy's RSS and open fds each second (/proc);
  the picker's own view of its pool (``/debug/pool``: who is stale) every 100 ms.

Faults, in turn, ``--hold`` seconds each (5), then ``--gap`` quiet seconds (12)
-------------------------------------------------------------------------------
* ``pod-kill``: SIGKILL a pod of the pool, start it again on the same address.
* ``metrics-html`` / ``-garbage`` / ``-hang`` / ``-500``: break a pod's metrics page (it still serves),
  held long enough to go stale (staleness + 1.5 s), then restore it.
* ``picker-kill``: SIGKILL the picker (its scrape worker must exit with it), start it again.
* ``envoy-restart``: stop Envoy (SIGTERM: it exits at once, cutting what it carries), start it again on
  the same ports one second later.
* ``watch-drop``: cut the picker's Kubernetes watches (a reset connection: it resumes from its
  resourceVersion) or, every other time, expire them (410: it re-lists), and at once take a pod out of
  the pool (NotReady) while the watches are down; the picker must see it when it watches again.
* ``pool-churn``: delete a pod from the pool and add the standby (the pod that left keeps running).

Accounting
----------
Every request is joined, by its id, with Envoy's access log and the pods' records. A request is

* **lost** when the client got no answer, a connection error, a cut stream or a status it did not
  expect (a 5xx, or a 404 from a pod that lacks the adapter);
* **misrouted** when a pod received it that was not in the pool (by the API server's truth at the
  request's start), that the picker's own view showed stale at the time, or that does not serve its
  model; requests Envoy sent round the picker (the fail-open route, "unpicked") are not the picker's
  choice and are judged as losses only.

Each loss or misroute is explained by a fault when it matches the fault's mechanism within its window,
below; anything else is UNEXPLAINED. A window's measured length is from the fault to the start of the
last request it cost; requests already in flight when the fault struck are counted apart.

==================  =========================================================  =====================
fault               mechanism that ends its effect                             bound (from fault)
==================  =========================================================  =====================
pod-kill            the next scrape (<= 50 ms) is refused: stale at once,      0.5 s; requests whose
                    ranked last; Envoy's own 503 for a pick marks it too        upstream was that pod
picker-kill         fail-open: the first refused connection ejects the         0.5 s (500s, cuts);
(fail-open)         picker (outlier detection, epp.envoy.bootstrap); then      the fallback's 404s
                    Envoy's round robin, which knows no models: an adapter     until 2.5 s after the
                    request may reach a pod without it (404) until the         picker is ready again
                    picker is back (2 health checks at 1 s after its
                    readiness)
picker-kill         every request fails (500) until the picker is ready and    1.5 s after it is
(fail-closed)       Envoy's next health check (1 s) sees it                    ready
envoy-restart       nothing answers while Envoy is down                        0.5 s after Envoy is
                                                                                ready
watch-drop          the picker resumes or re-lists within its 0.1 s backoff    1.0 s (requests to
                    and hears the pod left                                      the pod that left)
pool-churn          the watch event reaches the picker in milliseconds         0.5 s
metrics-*           none: the pod serves, goes stale after the threshold and   nothing may be lost
                    is ranked last; nothing may be lost or misrouted           or misrouted
==================  =========================================================  =====================

Results (``python bench/chaos.py --keep``: 30 min, fail-open, 2-core machine shared with another
session's tests, on the picker's own gRPC server, epp.wire, at 3bedd0e)
---------------------------------------------------------------------------------------------------------
54,142 requests (30.1/s); 53,483 answered as expected; 658 lost and 1 misrouted, every one inside a fault's
window; **0 unexplained**. 12 or 11 faults of each kind; windows are medians / maxima over them::

    fault          times  lost  in flight  misrouted  window  max     bound   measured (medians, s after the fault)
    pod-kill          12     7          4          0    0 ms    36 ms  500 ms  picker saw it stale 0.11; traffic
                                                                               again 0.20 after the restart
    metrics-html      12     0          0          0       -        -    none  stale 2.08; last request to it 1.97
    metrics-garbage   12     0          0          0       -        -    none  stale 2.08; last request to it 1.97
    metrics-hang      11     0          0          0       -        -    none  stale 2.24; last request to it 1.99
    metrics-500       11     0          0          0       -        -    none  stale 2.09; last request to it 1.90
    picker-kill       12   258         21          0    3 ms    51 ms  500 ms  Envoy saw it down 0.03; restart
                                                                               took 2.24; picked again 8.89
    envoy-restart     11   393         17          0 1138 ms  1480 ms  1728 ms  picker healthy 1.23 after the stop
    watch-drop        12     0          0          1   12 ms    12 ms 1000 ms  watching again 0.08
    pool-churn        11     0          0          0       -        -  500 ms  first request to the new pod 0.32

The run before it (5f5ac27, 54,136 requests, 0 unexplained) had the same windows within noise.
RSS and fds flat: the picker 113.0 MiB at start, 115.2 at most, 114.5 at the end (fds 24-28), its scrape
worker 27.7-27.9 MiB; no scrape worker outlived its SIGKILLed picker; no request reached a pod twice.
picker-kill's 258: 226 fail-open 404s (below), 23 500s and 9 cut streams of requests in flight or sent
within 51 ms. The picker's log over its lives: 80 warnings, all the faults' own (broken or refused
scrapes, watches cut mid-answer). The earlier run on grpc.aio (54,046 requests, 0 unexplained) had the same windows within
noise (pod-kill 0/32 ms, picker-kill 3/46 ms, watch-drop 42/72 ms, envoy-restart 1,447/1,730 ms); the
notes below are from it.

* pod-kill: 10 lost in 12 kills: 5 in flight on the pod (cut streams, Envoy's 503 "reset before headers"),
  5 sent in the 32 ms before the picker's next scrape was refused (Envoy's 503 for a dead pick). None
  later: the pod is stale at once and ranked last; back in traffic 0.15 s after it listens again.
* metrics broken (46 times, four ways): nothing lost or misrouted. The pod keeps serving and looks fresh
  until the 2 s staleness threshold (its last request 1.9-2.0 s after the break), then gets no request
  until the page is fixed (fresh again 0.07-0.15 s later). A hanging page is a scrape timeout (1 s) and
  the same 2 s.
* picker-kill: before a207d39 (Envoy fail-open ejects the picker at its first refused connection) each
  SIGKILL cost ~2 s of 500s, every POST until Envoy's health check had missed twice (``--minutes 1.5
  --faults picker-kill --hold 3 --gap 6``, six kills: 386 lost to 500s or cuts, the last sent 1.98 s after
  the kill; with a207d39 the same run lost 14, the last 23 ms after). Here 20 in 12 kills: 13 in flight on the picker
  (500, or a streamed answer cut), the rest sent within 46 ms. While the picker is away (~10 s here:
  5 s down, a restart of 3.9 s on this loaded machine, then two health checks) the fail-open route is
  round robin over a static list, which knows no models: 301 adapter requests reached a pod without the
  adapter and got its 404. That is what fail-open costs; the scrape worker always died with its picker.
* envoy-restart: 522 lost in 11 restarts: refused while Envoy is down (~1.5 s at 30/s), 12 cut when it
  stopped; none once it is ready (its start waits for the first health check of the picker).
* watch-drop: the picker watches again 0.07 s after its watches are cut or expired (re-listing after
  410) and never lost its pool; 5 requests reached the pod taken out of the pool while the watches were
  down, all within 72 ms; none after.
* pool-churn: the pod that left got no request sent after its deletion; the one that joined got its
  first 0.26 s later (its first scrape, then the load-aware scorers).
* Memory and descriptors (the PNG): the picker 119-123 MiB RSS and 31-34 fds in each of its 13 lives,
  flat; its scrape worker 27 MiB and 18 fds; Envoy 67-72 MiB, its fds (35-167) follow its open
  connections (sampled from its admin stats: clients and upstream pools, which swell after a restart or
  a picker outage and drain as idle connections close), not a leak. No request was received twice; no
  arrival was skipped by the client.
* The picker's log over its 13 lives: only the faults' own warnings, and one grpc.aio ERROR with a
  traceback (``ExecuteBatchError`` sending a stream's final status) 14 s after an Envoy restart, also once
  in an earlier 30-minute run (22 s after one): a stream whose Envoy went away is finished late and its
  status send fails in grpc's core. No request was lost with it.

``--fail-closed`` (6 minutes, the same faults): 0 unexplained; a killed picker fails every request (500)
for its whole absence (10.6 s median here: 5 s down, a 5.4 s restart, then Envoy's next health check);
the other faults as above.

What it does not cover: a watch that goes silent without its connection being closed (a black-holed
network path). The picker only notices when the read times out, the server-side watch timeout plus 30 s
(5.5-10.5 min); the fake API server can cut connections, not black-hole them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import itertools
import json
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from epp.envoy.bootstrap import EPP_CLUSTER, BootstrapOptions, render
from epp.kube.objectives import OBJECTIVE_GROUP, OBJECTIVE_PLURAL, OBJECTIVE_VERSION
from epp.testing.envoy import EnvoyProcess, free_port, free_ports
from epp.testing.fake_apiserver import INFERENCE_POOLS, PODS, FakeApiServer, Resource, make_pod, make_pool
from epp.testing.harness import PickerProcess, child_pids

MODEL = "meta-llama/Llama-3.1-8B-Instruct"  # the simulator's default served model
NAMESPACE = "default"
POOL = "chaos-pool"
POD_LABELS = {"app": "chaos-sim"}
# Loopback addresses of our own (127.0.42.x): pods in a cluster have their own IPs and one port; other
# benchmarks on this machine use 127.0.0.1 and 127.0.1.x.
HOST_PREFIX = "127.0.42."
FAULT_KINDS = (
    "pod-kill",
    "metrics-html",
    "picker-kill",
    "metrics-garbage",
    "watch-drop",
    "envoy-restart",
    "metrics-hang",
    "pool-churn",
    "metrics-500",
)
_RESULTS = Path(__file__).resolve().parent / "results"
RECORD = "received.jsonl"  # what the pods received, one line per request (epp.sim.faults)
ACCESS_LOG = "envoy-access.jsonl"  # Envoy's access log: the route and upstream of each request
PICKER_LOG = "picker.log"  # the picker's log, all its lives


# --- the pool --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PodSpec:
    name: str
    host: str
    adapters: tuple[str, ...]
    in_pool: bool  # at the start (sim-4 is the standby that pool-churn swaps in)
    fallback: bool  # listed in Envoy's fail-open round robin (pods never removed from the pool)


LAYOUT = (
    PodSpec("sim-0", HOST_PREFIX + "1", ("sql-lora",), True, True),
    PodSpec("sim-1", HOST_PREFIX + "2", ("sql-lora", "chat-lora"), True, True),
    PodSpec("sim-2", HOST_PREFIX + "3", ("chat-lora",), True, True),
    PodSpec("sim-3", HOST_PREFIX + "4", (), True, False),
    PodSpec("sim-4", HOST_PREFIX + "5", ("sql-lora", "chat-lora"), False, False),
)


class Pod:
    """One simulated pod in its own process (``python -m epp.sim``), so it can be SIGKILLed alone."""

    def __init__(self, spec: PodSpec, port: int, workdir: Path, time_scale: float) -> None:
        self.spec = spec
        self.port = port
        self.record = workdir / RECORD  # every pod appends to the same file, one line per request
        self._log = workdir / f"{spec.name}.log"
        self._args = [
            sys.executable, "-m", "epp.sim", "--pods", "1", "--name", spec.name,
            "--host", spec.host, "--base-port", str(port), "--time-scale", str(time_scale),
            "--seed", spec.host.rsplit(".", 1)[1], "--max-loras", "2", "--fault-control", "--record", str(self.record),
        ]  # fmt: skip
        if spec.adapters:
            self._args += ["--lora-adapters", ",".join(spec.adapters)]
        self.process: asyncio.subprocess.Process | None = None

    @property
    def hostport(self) -> str:
        return f"{self.spec.host}:{self.port}"

    async def start(self, timeout: float = 30.0) -> None:
        """Start the pod and return once it listens."""
        with open(self._log, "ab") as log:
            self.process = await asyncio.create_subprocess_exec(
                *self._args, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=log
            )
        assert self.process.stdout is not None
        try:
            line = await asyncio.wait_for(self.process.stdout.readline(), timeout)
        except TimeoutError:
            line = b""
        if not line.startswith(self.spec.name.encode()):
            await self.kill()
            tail = self._log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{self.spec.name} did not start on {self.hostport}:\n{tail}")

    async def kill(self) -> None:
        """SIGKILL: no goodbye to anyone (its connections are reset by the kernel)."""
        if self.process is not None and self.process.returncode is None:
            self.process.kill()
            await self.process.wait()

    async def stop(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.terminate()
            try:
                await asyncio.wait_for(self.process.wait(), 10)
            except TimeoutError:
                await self.kill()

    async def set_metrics(self, session: aiohttp.ClientSession, mode: str) -> None:
        url = f"http://{self.hostport}/sim/faults/metrics"
        async with session.put(url, data=mode, timeout=aiohttp.ClientTimeout(total=5)) as response:
            if response.status != 200:
                raise RuntimeError(f"{self.spec.name}: metrics mode {mode}: {response.status} {await response.text()}")


async def start_pods(workdir: Path, time_scale: float) -> dict[str, Pod]:
    """Every pod of the layout on one port (each on its own loopback address); another port if one is taken."""
    for _ in range(5):
        port = free_port()
        pods = {spec.name: Pod(spec, port, workdir, time_scale) for spec in LAYOUT}
        try:
            await asyncio.gather(*(pod.start() for pod in pods.values()))
            return pods
        except RuntimeError as exc:
            await asyncio.gather(*(pod.kill() for pod in pods.values()))
            if "address already in use" not in str(exc).lower() and str(errno.EADDRINUSE) not in str(exc):
                raise
    raise RuntimeError("no port free on every pod address")


# --- the load --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """One kind of request of the mix."""

    name: str
    method: str
    path: str
    model: str | None
    stream: bool
    expect: int
    weight: float


MIX = (
    Shape("chat", "POST", "/v1/chat/completions", MODEL, False, 200, 3),
    Shape("chat-stream", "POST", "/v1/chat/completions", MODEL, True, 200, 3),
    Shape("completion-stream", "POST", "/v1/completions", MODEL, True, 200, 2),
    Shape("completion", "POST", "/v1/completions", MODEL, False, 200, 2),
    Shape("sql-lora", "POST", "/v1/completions", "sql-lora", False, 200, 2),
    Shape("chat-lora-stream", "POST", "/v1/chat/completions", "chat-lora", True, 200, 2),
    Shape("unique-prompt", "POST", "/v1/completions", MODEL, False, 200, 2),
    Shape("not-json", "POST", "/v1/completions", None, False, 400, 0.5),
    Shape("models", "GET", "/v1/models", None, False, 200, 0.5),
)
# Shared document prefixes, so that the prefix-cache scorer has something to prefer.
_DOCUMENTS = [
    " ".join(f"section {d}.{i}: the figures for region {d} show item {i} at {d * i} units." for i in range(12))
    for d in range(16)
]


def _body(shape: Shape, rng: random.Random, number: int) -> bytes | None:
    if shape.method == "GET":
        return None
    if shape.model is None:
        return b'{"model": "' + MODEL.encode() + b'", "prompt": "not json'
    document = rng.choice(_DOCUMENTS) if shape.name != "unique-prompt" else f"{rng.random()} unique {number}"
    question = f"question {number}: what changed for item {rng.randrange(12)}?"
    body: dict[str, Any] = {"model": shape.model, "max_tokens": rng.choice((8, 16, 24)), "stream": shape.stream}
    if shape.path.endswith("chat/completions"):
        body["messages"] = [{"role": "system", "content": document}, {"role": "user", "content": question}]
    else:
        body["prompt"] = document + "\n" + question
    return json.dumps(body).encode()


@dataclass(slots=True)
class Result:
    """What the client saw of one request."""

    id: str
    shape: str
    model: str | None
    t0: float  # time.time() when sent
    t1: float = 0.0  # when the answer was complete (or failed)
    status: int | None = None
    error: str | None = None  # None: answered as expected
    pod: str | None = None  # x-sim-pod of the answer


class Load:
    """An open-loop Poisson stream of the mix at ``rate`` requests/s, at most ``max_in_flight`` at a time."""

    def __init__(self, url: str, rate: float, max_in_flight: int, seed: int, run: str) -> None:
        self.url = url
        self.rate = rate
        self.max_in_flight = max_in_flight
        self.rng = random.Random(seed)
        self.run = run
        self.results: list[Result] = []
        self.skipped = 0  # arrivals dropped by the client because max_in_flight were outstanding
        self._in_flight = 0
        self._tasks: set[asyncio.Task[None]] = set()

    async def run_until(self, deadline: float) -> None:
        connector = aiohttp.TCPConnector(limit=self.max_in_flight, force_close=False)
        timeout = aiohttp.ClientTimeout(total=30, sock_connect=5)
        shapes = list(MIX)
        weights = [s.weight for s in MIX]
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            next_at = time.monotonic()
            for number in itertools.count():
                next_at += self.rng.expovariate(self.rate)
                delay = next_at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                if time.time() >= deadline:
                    break
                if self._in_flight >= self.max_in_flight:
                    self.skipped += 1
                    continue
                shape = self.rng.choices(shapes, weights)[0]
                task = asyncio.create_task(self._send(session, shape, number))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            if self._tasks:
                await asyncio.wait(self._tasks, timeout=40)

    async def _send(self, session: aiohttp.ClientSession, shape: Shape, number: int) -> None:
        self._in_flight += 1
        result = Result(f"{self.run}-{number}", shape.name, shape.model, time.time())
        self.results.append(result)
        body = _body(shape, self.rng, number)
        headers = {"x-request-id": result.id}
        if body is not None:
            headers["content-type"] = "application/json"
        try:
            async with session.request(shape.method, self.url + shape.path, data=body, headers=headers) as response:
                result.status = response.status
                result.pod = response.headers.get("x-sim-pod")
                payload = await response.read()
            result.error = _check(shape, response.status, payload)
        except TimeoutError:
            result.error = "timeout"
        except aiohttp.ClientConnectorError:
            result.error = "connect refused"
        except aiohttp.ClientPayloadError:
            result.error = "answer cut"
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
            result.error = "disconnected"
        except aiohttp.ClientError as exc:
            result.error = type(exc).__name__
        finally:
            result.t1 = time.time()
            self._in_flight -= 1


def _check(shape: Shape, status: int, payload: bytes) -> str | None:
    """None if the answer is what ``shape`` expects, else what was wrong."""
    if status != shape.expect:
        return f"status {status}"
    if status != 200:
        return None
    if shape.stream:
        return None if payload.rstrip().endswith(b"data: [DONE]") else "stream incomplete"
    try:
        answer = json.loads(payload)
    except ValueError:
        return "answer not JSON"
    key = "data" if shape.method == "GET" else "choices"
    return None if isinstance(answer, dict) and answer.get(key) else "answer incomplete"


# --- what the processes look like from /proc -------------------------------------------------------------


def _proc_status(pid: int) -> tuple[int, int] | None:
    """(RSS bytes, open fds) of ``pid``, None if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
                break
        else:
            return None
        return rss, len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError):
        return None


@dataclass(slots=True)
class Sample:
    t: float
    picker: tuple[int, int] | None  # (RSS, fds) of the picker's main process
    worker: tuple[int, int] | None  # of its scrape worker
    envoy: tuple[int, int] | None
    envoy_connections: tuple[int, int] | None = None  # Envoy's open connections: (from clients, to upstreams)


@dataclass(slots=True)
class View:
    """The picker's own view of its pool (``/debug/pool``) at ``t``: pod -> stale?; None: no answer."""

    t: float
    stale: dict[str, bool] | None


# --- faults ----------------------------------------------------------------------------------------------


@dataclass
class Fault:
    kind: str
    target: str | None
    start: float  # time.time() when the fault was injected
    end: float = 0.0  # when it was undone (pod back up, page restored, picker or Envoy ready again)
    notes: dict[str, float] = field(default_factory=dict)  # measured moments, seconds after start
    variant: str = ""


@dataclass
class Evidence:
    """Everything a run leaves for the analysis, besides the pods' record and Envoy's access log in
    ``workdir``; saved there as evidence.json, so that ``--reanalyse DIR`` reads a run again."""

    args: dict[str, Any]
    workdir: Path
    t0: float
    pods: dict[str, tuple[str, tuple[str, ...]]]  # name -> (ip:port, adapters it serves)
    results: list[Result]
    skipped: int
    faults: list[Fault]
    samples: list[Sample]
    views: list[View]
    in_pool: dict[str, list[tuple[float, bool]]]
    orphans: list[int]

    @property
    def fail_open(self) -> bool:
        return not self.args["fail_closed"]

    def save(self) -> Path:
        path = self.workdir / "evidence.json"
        data = {
            "args": self.args, "t0": self.t0, "pods": self.pods, "skipped": self.skipped, "orphans": self.orphans,
            "in_pool": self.in_pool,
            "results": [[getattr(r, f) for f in Result.__slots__] for r in self.results],
            "faults": [vars(f) for f in self.faults],
            "samples": [[s.t, s.picker, s.worker, s.envoy, s.envoy_connections] for s in self.samples],
            "views": [[v.t, v.stale] for v in self.views],
        }  # fmt: skip
        path.write_text(json.dumps(data))
        return path

    @classmethod
    def load(cls, workdir: Path) -> Evidence:
        data = json.loads((workdir / "evidence.json").read_text())

        def pair(value: list[int] | None) -> tuple[int, int] | None:
            return None if value is None else (value[0], value[1])

        return cls(
            data["args"], workdir, data["t0"],
            {name: (hostport, tuple(adapters)) for name, (hostport, adapters) in data["pods"].items()},
            [Result(*row) for row in data["results"]], data["skipped"], [Fault(**f) for f in data["faults"]],
            [Sample(t, *(pair(v) for v in rest)) for t, *rest in data["samples"]],
            [View(t, stale) for t, stale in data["views"]],
            {name: [(t, member) for t, member in changes] for name, changes in data["in_pool"].items()},
            data["orphans"],
        )  # fmt: skip


class Bench:
    """Every process of the run, the load, the samplers, and the faults injected so far."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.fail_open = not args.fail_closed
        self.pods: dict[str, Pod] = {}
        # The InferenceObjective CRD installed too (no objectives): the picker watches it.
        objectives = Resource(OBJECTIVE_GROUP, OBJECTIVE_VERSION, OBJECTIVE_PLURAL, "InferenceObjective")
        self.api = FakeApiServer((PODS, INFERENCE_POOLS, objectives), token="chaos-token", bookmark_interval=0.5)
        self.picker: PickerProcess | None = None
        self.envoy: EnvoyProcess | None = None
        self.access_log = workdir / ACCESS_LOG
        self.faults: list[Fault] = []
        self.samples: list[Sample] = []
        self.views: list[View] = []
        self.in_pool: dict[str, list[tuple[float, bool]]] = defaultdict(list)  # pod -> (time, member?) changes
        self.orphans: list[int] = []  # scrape workers still alive after their picker was killed
        self.session: aiohttp.ClientSession | None = None
        self._rng = random.Random(args.seed)
        self._listen_port, self._admin_port = free_ports(2)
        self.t0 = 0.0  # when the traffic started

    def evidence(self, load: Load) -> Evidence:
        return Evidence(
            vars(self.args), self.workdir, self.t0,
            {name: (pod.hostport, (MODEL, *pod.spec.adapters)) for name, pod in self.pods.items()},
            load.results, load.skipped, self.faults, self.samples, self.views, dict(self.in_pool), self.orphans,
        )  # fmt: skip

    # -- start and stop --

    async def start(self) -> None:
        self.session = aiohttp.ClientSession()
        self.pods = await start_pods(self.workdir, self.args.time_scale)
        await self.api.start()
        port = next(iter(self.pods.values())).port
        self.api.apply(make_pool(POOL, POD_LABELS, [port], namespace=NAMESPACE))
        for pod in self.pods.values():
            if pod.spec.in_pool:
                self._add_to_pool(pod.spec.name)
        kubeconfig = self.api.kubeconfig(self.workdir / "kubeconfig")
        self.picker = PickerProcess(
            None,
            extra_args=[
                "--pool-name", POOL, "--pool-namespace", NAMESPACE, "--kubeconfig", str(kubeconfig),
                "--metrics-endpoint-auth=false", "--enable-debug-endpoints=true",
                f"--metrics-staleness-threshold={self.args.staleness:g}s", *self.args.picker_arg,
            ],
        )  # fmt: skip
        await asyncio.to_thread(self.picker.start)
        self.envoy = EnvoyProcess(self._bootstrap(), workdir=self.workdir / "envoy", concurrency=2)
        await asyncio.to_thread(self.envoy.start)
        await self._wait_envoy_healthy(30.0)

    def _bootstrap(self) -> dict[str, Any]:
        assert self.picker is not None
        fallback = tuple(p.hostport for p in self.pods.values() if p.spec.fallback)
        options = BootstrapOptions(
            listen_address="127.0.0.1",
            listen_port=self._listen_port,
            admin_port=self._admin_port,
            picker_port=self.picker.grpc_port,
            fail_open=self.fail_open,
            pool_endpoints=fallback if self.fail_open else (),
        )
        config = render(options)
        # Observation only: an access log line per request, to tell which route and upstream each one took.
        manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        manager["access_log"] = [
            {
                "name": "envoy.access_loggers.file",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                    "path": str(self.access_log),
                    "log_format": {
                        "json_format": {
                            "id": "%REQ(X-REQUEST-ID)%",
                            "route": "%ROUTE_NAME%",
                            "upstream": "%UPSTREAM_HOST%",
                            "status": "%RESPONSE_CODE%",
                            "flags": "%RESPONSE_FLAGS%",
                            "details": "%RESPONSE_CODE_DETAILS%",
                            "start": "%START_TIME(%s.%3f)%",
                        }
                    },
                },
            }
        ]
        return config

    async def stop(self) -> None:
        if self.envoy is not None:
            await asyncio.to_thread(self.envoy.stop)
        if self.picker is not None:
            await asyncio.to_thread(self.picker.stop)
            (self.workdir / PICKER_LOG).write_text(self.picker.log_tail(1_000_000))
        await asyncio.gather(*(pod.stop() for pod in self.pods.values()))
        await self.api.stop()
        if self.session is not None:
            await self.session.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._listen_port}"

    # -- pool membership (the API server is the truth) --

    def _add_to_pool(self, name: str) -> None:
        self.api.apply(make_pod(name, self.pods[name].spec.host, labels=POD_LABELS, namespace=NAMESPACE))
        self.in_pool[name].append((time.time(), True))

    def _remove_from_pool(self, name: str) -> None:
        self.api.delete(PODS, NAMESPACE, name)
        self.in_pool[name].append((time.time(), False))

    def members(self) -> list[str]:
        return [name for name, changes in self.in_pool.items() if changes and changes[-1][1]]

    # -- samplers --

    async def sample_processes(self, deadline: float) -> None:
        while time.time() < deadline:
            process = self.picker.process if self.picker is not None else None
            main = _proc_status(process.pid) if process is not None and process.poll() is None else None
            workers = child_pids(process.pid) if process is not None and main is not None else []
            worker = _proc_status(workers[0]) if workers else None
            envoy = connections = None
            with contextlib.suppress(Exception):  # Envoy is not running (being restarted)
                envoy = _proc_status(self.envoy.pid) if self.envoy is not None else None
                connections = await asyncio.to_thread(self._envoy_connections)
            self.samples.append(Sample(time.time(), main, worker, envoy, connections))
            await asyncio.sleep(self.args.sample_interval)

    def _envoy_connections(self) -> tuple[int, int]:
        """Envoy's open connections from clients and to every upstream (pods, the picker): what its fds hold."""
        assert self.envoy is not None
        stats = self.envoy.stats(r"^(http\.ingress_http\.downstream_cx_active|cluster\.[^.]+\.upstream_cx_active)$")
        downstream = stats.pop("http.ingress_http.downstream_cx_active", 0)
        return downstream, sum(stats.values())

    async def watch_picker_view(self, deadline: float) -> None:
        assert self.session is not None and self.picker is not None
        url = f"http://127.0.0.1:{self.picker.metrics_port}/debug/pool"
        timeout = aiohttp.ClientTimeout(total=0.5)
        while time.time() < deadline:
            stale: dict[str, bool] | None
            try:
                async with self.session.get(url, timeout=timeout) as response:
                    pool = await response.json() if response.status == 200 else None
                stale = (
                    None
                    if pool is None
                    else {e["name"].removesuffix("-rank-0"): bool(e["metrics"]["stale"]) for e in pool["endpoints"]}
                )
            except (aiohttp.ClientError, TimeoutError, ValueError, KeyError):
                stale = None
            self.views.append(View(time.time(), stale))
            await asyncio.sleep(0.1)

    def _envoy_healthy_pickers(self) -> int | None:
        try:
            assert self.envoy is not None
            name = f"cluster.{EPP_CLUSTER}.membership_healthy"
            return self.envoy.stats(rf"^cluster\.{EPP_CLUSTER}\.membership_healthy$").get(name)
        except Exception:
            return None

    async def _wait_envoy_healthy(self, timeout: float, *, healthy: bool = True) -> float | None:
        """Wait until Envoy's health check counts the picker healthy (or not); the time, None on timeout."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            value = await asyncio.to_thread(self._envoy_healthy_pickers)
            now = time.time()
            if value == (1 if healthy else 0):
                return now
            await asyncio.sleep(0.05)
        return None

    # -- the faults --

    async def inject(self, kind: str, hold: float) -> Fault:
        method: Callable[[float], Any] = getattr(self, "_" + kind.replace("-", "_"))
        fault: Fault = await method(hold)
        self.faults.append(fault)
        return fault

    def _pick(self, candidates: Sequence[str]) -> str:
        return self._rng.choice(sorted(candidates))

    async def _pod_kill(self, hold: float) -> Fault:
        name = self._pick(self.members())
        pod = self.pods[name]
        fault = Fault("pod-kill", name, time.time())
        await pod.kill()
        await asyncio.sleep(hold)
        await pod.start()
        fault.end = time.time()
        return fault

    async def _metrics(self, mode: str, hold: float) -> Fault:
        assert self.session is not None
        name = self._pick(self.members())
        fault = Fault(f"metrics-{mode}", name, time.time())
        await self.pods[name].set_metrics(self.session, mode)
        await asyncio.sleep(hold)
        await self.pods[name].set_metrics(self.session, "ok")
        fault.end = time.time()
        return fault

    async def _metrics_html(self, hold: float) -> Fault:
        return await self._metrics("html", hold)

    async def _metrics_garbage(self, hold: float) -> Fault:
        return await self._metrics("garbage", hold)

    async def _metrics_hang(self, hold: float) -> Fault:
        return await self._metrics("hang", hold)

    async def _metrics_500(self, hold: float) -> Fault:
        return await self._metrics("500", hold)

    async def _picker_kill(self, hold: float) -> Fault:
        assert self.picker is not None and self.picker.process is not None
        main = self.picker.process.pid
        workers = child_pids(main)
        fault = Fault("picker-kill", None, time.time())
        self.picker.process.kill()
        await asyncio.to_thread(self.picker.process.wait)
        unhealthy = await self._wait_envoy_healthy(10.0, healthy=False)
        if unhealthy is not None:
            fault.notes["envoy saw it down"] = unhealthy - fault.start
        await asyncio.sleep(max(0.0, fault.start + hold - time.time()))
        for worker in workers:  # the worker exits when its socket to the parent closes
            if _proc_status(worker) is not None:
                self.orphans.append(worker)
        restart = time.time()
        await asyncio.to_thread(self.picker.start)
        fault.end = time.time()
        fault.notes["restart took"] = fault.end - restart
        healthy = await self._wait_envoy_healthy(15.0)
        if healthy is not None:
            fault.notes["envoy saw it up"] = healthy - fault.start
        return fault

    async def _envoy_restart(self, hold: float) -> Fault:
        assert self.envoy is not None
        fault = Fault("envoy-restart", None, time.time())
        await asyncio.to_thread(self.envoy.stop)
        fault.notes["stopped"] = time.time() - fault.start
        await asyncio.sleep(max(0.0, fault.start + min(hold, 1.0) - time.time()))
        await asyncio.to_thread(self.envoy.start)
        fault.end = time.time()
        healthy = await self._wait_envoy_healthy(15.0)
        if healthy is not None:
            fault.notes["picker healthy"] = healthy - fault.start
        return fault

    async def _watch_drop(self, hold: float) -> Fault:
        # Cut the watches (a reset connection: the picker resumes from its resourceVersion) or expire
        # them (410: it re-lists), and change the pool while they are down: the picker must see it.
        variant = "expire" if sum(f.kind == "watch-drop" for f in self.faults) % 2 else "drop"
        name = self._pick([m for m in self.members() if not self.pods[m].spec.fallback])
        watches = self.api.open_watches
        before = len(self.api.requests)
        fault = Fault("watch-drop", name, time.time(), variant=variant)
        if variant == "drop":
            self.api.drop_watches()
        else:
            self.api.expire_watches()
        self.api.set_ready(NAMESPACE, name, False)
        self.in_pool[name].append((time.time(), False))
        # Watching again: as many new watch requests as there were open watches (the pods', the pool's).
        while time.time() < fault.start + 30:
            if sum(1 for r in self.api.requests[before:] if r.watch) >= watches:
                fault.notes["watching again"] = time.time() - fault.start
                break
            await asyncio.sleep(0.005)
        fault.notes["lists"] = float(sum(1 for r in self.api.requests[before:] if not r.watch))
        await asyncio.sleep(max(0.0, fault.start + hold - time.time()))
        self.api.set_ready(NAMESPACE, name, True)
        self.in_pool[name].append((time.time(), True))
        fault.end = time.time()
        return fault

    async def _pool_churn(self, hold: float) -> Fault:
        out = self._pick([m for m in self.members() if not self.pods[m].spec.fallback])
        spare = [name for name in self.pods if name not in self.members()]
        into = self._pick(spare)
        fault = Fault("pool-churn", f"{out}->{into}", time.time())
        self._remove_from_pool(out)
        self._add_to_pool(into)
        await asyncio.sleep(hold)
        fault.end = time.time()
        return fault

    async def run_faults(self, kinds: Sequence[str], deadline: float) -> None:
        await asyncio.sleep(self.args.gap)  # a quiet start: the baseline
        for kind in itertools.cycle(kinds):
            hold = self.args.hold
            if kind.startswith("metrics-"):
                hold = max(hold, self.args.staleness + 1.5)  # long enough to go stale and be seen stale
            restart = 10.0 if kind in ("picker-kill", "envoy-restart") else 3.0  # starting processes again
            if time.time() + hold + restart + self.args.gap > deadline:
                return
            fault = await self.inject(kind, hold)
            print(
                f"  {fault.start - self.t0:7.1f}s  {fault.kind:<16} {fault.variant:<7}{fault.target or '':<14} "
                + "; ".join(f"{k} {v:.2f}" for k, v in fault.notes.items()),
                flush=True,
            )
            await asyncio.sleep(self.args.gap)


# --- reading the evidence --------------------------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    with contextlib.suppress(FileNotFoundError), open(path, encoding="utf-8", errors="replace") as lines:
        for line in lines:
            with contextlib.suppress(ValueError):
                rows.append(json.loads(line))
    return rows


# How long after a fault its effects are explained by the mechanism that deals with it (derived in the
# module docstring); a request lost or misrouted later than this is unexplained.
KILL_BOUND = 0.5  # a killed pod's next scrape (<= 50 ms) is refused: stale at once (+ 10 ms worker batch, + slack)
PICKER_GONE_BOUND = 0.5  # fail-open: the first refused connection to a killed picker ejects it (+ slack)
PICKER_BACK_BOUND = 2.5  # fail-open: a ready picker is back after 2 health checks at 1 s (+ slack)
HEALTH_UP_BOUND = 1.5  # fail-closed: a ready picker is back after Envoy's next health check at 1 s (+ slack)
ENVOY_BOUND = 0.5  # Envoy restarted: after its /ready, requests in flight on the client's side still land
MEMBERSHIP_BOUND = 0.5  # a pod left the pool: the watch event reaches the picker within milliseconds
REWATCH_BOUND = 1.0  # a pod left while the watches were cut: the picker's resume (0.05-0.1 s backoff) + the event


@dataclass
class Outcome:
    """One request, with everything known of it."""

    result: Result
    envoy: dict[str, Any] | None
    received: list[dict[str, Any]]
    lost: str | None = None  # why the client got no (right) answer
    misrouted: str | None = None  # why the pod it reached was the wrong one
    fault: Fault | None = None  # the fault that explains it
    note: str = ""

    @property
    def bad(self) -> bool:
        return self.lost is not None or self.misrouted is not None

    def describe(self) -> str:
        r = self.result
        envoy = self.envoy or {}
        where = ",".join(x["pod"] for x in self.received) or "-"
        return (
            f"{r.id} {r.shape} t0={r.t0:.3f} took {1000 * (r.t1 - r.t0):.0f} ms: "
            f"{self.lost or ''} {self.misrouted or ''} "
            f"| envoy route={envoy.get('route')} upstream={envoy.get('upstream')} status={envoy.get('status')} "
            f"flags={envoy.get('flags')} details={envoy.get('details')} | received by {where} {self.note}"
        )


_LOG_LINE = re.compile(r"^\S+ \S+ (ERROR|WARNING|CRITICAL) (\S+): (.*)$")


def log_problems(path: Path) -> Counter[tuple[str, str]]:
    """The picker's warnings and errors, by (level, "logger: message" with numbers and addresses masked)."""
    problems: Counter[tuple[str, str]] = Counter()
    with contextlib.suppress(FileNotFoundError), open(path, encoding="utf-8", errors="replace") as lines:
        for line in lines:
            match = _LOG_LINE.match(line.rstrip())
            if match:
                level, logger, message = match.groups()
                problems[(level, f"{logger}: {re.sub(r'[0-9][0-9.:]*', 'N', message)[:160]}")] += 1
            elif line.startswith("Traceback"):
                problems[("TRACEBACK", "a traceback")] += 1
    return problems


@dataclass
class Report:
    evidence: Evidence
    duration: float
    outcomes: list[Outcome]
    per_fault: dict[int, list[Outcome]]  # id(fault) -> the requests it explains
    measured: dict[int, dict[str, float]]  # id(fault) -> measured moments (seconds)
    unexplained: list[Outcome]
    duplicates: list[str]
    problems: Counter[tuple[str, str]]  # the picker's log: warnings and errors

    @property
    def args(self) -> argparse.Namespace:
        return argparse.Namespace(**self.evidence.args)

    @property
    def t0(self) -> float:
        return self.evidence.t0

    @property
    def faults(self) -> list[Fault]:
        return self.evidence.faults

    def print(self) -> None:
        print_report(self)


@dataclass(frozen=True)
class Span:
    """A stretch of the picker's view in which a pod was stale: seen stale first at ``first``, last at
    ``last``, then seen fresh (or gone) at ``fresh``."""

    first: float
    last: float
    fresh: float

    def knew(self, sent: float, received: float) -> bool:
        """Whether the picker showed the pod stale both before a request was sent and after the pod received
        it: its pick, in between, was made knowing."""
        return self.first <= sent and received <= self.last


def _intervals(views: list[View], name: str) -> list[Span]:
    """When the picker's view showed ``name`` stale."""
    spans: list[Span] = []
    first: float | None = None
    last = 0.0
    for view in views:
        if view.stale is None:  # no answer (the picker is down): no view
            continue
        if view.stale.get(name, False):
            first = view.t if first is None else first
            last = view.t
        elif first is not None:
            spans.append(Span(first, last, view.t))
            first = None
    if first is not None:
        spans.append(Span(first, last, views[-1].t))
    return spans


def _member(changes: list[tuple[float, bool]], t: float) -> bool:
    member = False
    for when, state in changes:
        if when > t:
            break
        member = state
    return member


def analyse(evidence: Evidence) -> Report:
    envoy = {row.get("id"): row for row in read_jsonl(evidence.workdir / ACCESS_LOG)}
    received: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in read_jsonl(evidence.workdir / RECORD):
        received[row.get("id") or ""].append(row)
    by_hostport = {hostport: name for name, (hostport, _) in evidence.pods.items()}
    serves = {name: set(models) for name, (_, models) in evidence.pods.items()}
    stale_spans = {name: _intervals(evidence.views, name) for name in evidence.pods}
    in_pool = defaultdict(list, evidence.in_pool)
    outcomes = [Outcome(r, envoy.get(r.id), received.get(r.id, [])) for r in evidence.results]
    duplicates = [o.result.id for o in outcomes if len(o.received) > 1]

    # What went wrong with each request, before asking why.
    for o in outcomes:
        r = o.result
        for row in o.received:
            pod, model = row["pod"], row.get("model")
            if model is not None and model not in serves[pod] and (o.envoy or {}).get("route") != "unpicked":
                o.misrouted = f"{pod} does not serve {model}"
            elif (
                not _member(in_pool[pod], r.t0)
                and not _member(in_pool[pod], row["t"])  # a pod added while the request was on its way is fine
                and (o.envoy or {}).get("route") != "unpicked"
            ):
                o.misrouted = f"{pod} was not in the pool"
            elif (o.envoy or {}).get("route") == "picked" and any(
                span.knew(r.t0, row["t"]) for span in stale_spans[pod]
            ):
                o.misrouted = f"{pod} was stale in the picker's view"
        if r.error is not None and not (o.misrouted and r.error == "status 404"):
            o.lost = r.error
    # Which fault explains it.
    per_fault: dict[int, list[Outcome]] = defaultdict(list)
    for o in outcomes:
        if not o.bad:
            continue
        for fault in evidence.faults:
            if _explains(evidence, fault, o, by_hostport):
                o.fault = fault
                per_fault[id(fault)].append(o)
                break
    measured = {id(f): _measure(evidence, f, outcomes, stale_spans) for f in evidence.faults}
    unexplained = [o for o in outcomes if o.bad and o.fault is None]
    results = evidence.results
    duration = max(r.t1 for r in results) - min(r.t0 for r in results) if results else 0.0
    problems = log_problems(evidence.workdir / PICKER_LOG)
    return Report(evidence, duration, outcomes, per_fault, measured, unexplained, duplicates, problems)


def _overlaps(r: Result, start: float, end: float) -> bool:
    return r.t0 <= end and r.t1 >= start


def _model_blind(o: Outcome, start: float, end: float) -> bool:
    """A 404 from a pod Envoy's fail-open round robin chose: it knows no models (explained while the picker is away)."""
    if (o.envoy or {}).get("route") == "unpicked" and o.lost == "status 404" and start <= o.result.t0 <= end:
        o.note = "fail-open: model-blind round robin"
        return True
    return False


_CONNECTION_LOSSES = ("connect refused", "disconnected", "answer cut", "stream incomplete", "timeout")


def deadline(evidence: Evidence, fault: Fault) -> float:
    """Until when the mechanism that handles ``fault`` explains what it costs (time.time())."""
    if fault.kind == "pod-kill":
        return fault.start + KILL_BOUND
    if fault.kind == "picker-kill":
        return fault.start + PICKER_GONE_BOUND if evidence.fail_open else fault.end + HEALTH_UP_BOUND
    if fault.kind == "envoy-restart":
        return fault.end + ENVOY_BOUND
    if fault.kind == "pool-churn":
        return fault.start + MEMBERSHIP_BOUND
    if fault.kind == "watch-drop":
        return fault.start + REWATCH_BOUND
    return fault.start  # a broken metrics page: nothing may be lost (the pod still serves)


def _explains(evidence: Evidence, fault: Fault, o: Outcome, by_hostport: dict[str, str]) -> bool:
    r, envoy = o.result, o.envoy or {}
    until = deadline(evidence, fault)
    picker_failed = str(envoy.get("details", "")).startswith("ext_proc")
    if fault.kind == "pod-kill":
        # In flight on the pod when it died, or sent there before the picker could know.
        upstream = by_hostport.get(str(envoy.get("upstream")))
        return o.lost is not None and upstream == fault.target and _overlaps(r, fault.start, until)
    if fault.kind == "picker-kill":
        # The picker's streams die with it; then Envoy sends it requests until its health check notices
        # (fail-open), or until the picker is back (fail-closed). Meanwhile fail-open's round robin knows no models.
        if o.lost is not None and _overlaps(r, fault.start, until) and (picker_failed or o.lost in _CONNECTION_LOSSES):
            return True
        return evidence.fail_open and _model_blind(o, fault.start, fault.end + PICKER_BACK_BOUND)
    if fault.kind == "envoy-restart":
        if o.lost in _CONNECTION_LOSSES and _overlaps(r, fault.start, until):
            return True  # refused while Envoy was down, or cut when it stopped
        if evidence.fail_open:
            return _model_blind(o, fault.start, until)
        return o.lost is not None and picker_failed and fault.start <= r.t0 <= until
    if fault.kind in ("pool-churn", "watch-drop"):
        # The pod that left may get requests until the picker hears of it: a misroute, not a loss.
        left = fault.target.split("->")[0] if fault.target else None
        return o.lost is None and o.misrouted == f"{left} was not in the pool" and fault.start <= r.t0 <= until
    return False


def _first(times: Iterator[float]) -> float | None:
    return next(times, None)


def _measure(
    evidence: Evidence, fault: Fault, outcomes: list[Outcome], stale: dict[str, list[Span]]
) -> dict[str, float]:
    """Moments of the fault seen from outside (seconds after its start, or after its end where said)."""
    measured = dict(fault.notes)
    target = fault.target.split("->")[0] if fault.target else ""
    if fault.kind == "pod-kill" or fault.kind.startswith("metrics-"):
        seen = _first(span.first for span in stale[target] if fault.start <= span.first <= fault.end + 1)
        if seen is not None:
            measured["picker saw it stale"] = seen - fault.start
        fresh = _first(span.fresh for span in stale[target] if span.fresh >= fault.end)
        if fresh is not None:
            measured["fresh again after the fix"] = fresh - fault.end
        # The first request it got after the fix, if before it left the pool or the next fault began.
        later = [f.start for f in evidence.faults if f.start > fault.start] + [
            t for t, member in evidence.in_pool.get(target, []) if t > fault.end and not member
        ]
        until = min(later, default=float("inf"))
        back = _first(
            o.result.t0
            for o in outcomes
            if fault.end <= o.result.t0 < until and any(x["pod"] == target for x in o.received)
        )
        if back is not None:
            measured["traffic again after the fix"] = back - fault.end
        last = [
            o.result.t0
            for o in outcomes
            if fault.start <= o.result.t0 <= fault.end and any(x["pod"] == target for x in o.received)
        ]
        if last and fault.kind.startswith("metrics-"):
            measured["last request to it"] = max(last) - fault.start
    if fault.kind in ("pool-churn", "watch-drop") and target:
        last = [
            o.result.t0
            for o in outcomes
            if fault.start <= o.result.t0 <= fault.end and any(x["pod"] == target for x in o.received)
        ]
        measured["last request to the pod that left"] = (max(last) - fault.start) if last else 0.0
        if fault.kind == "pool-churn" and fault.target:
            added = fault.target.split("->")[1]
            first = _first(
                o.result.t0
                for o in outcomes
                if o.result.t0 >= fault.start and any(x["pod"] == added for x in o.received)
            )
            if first is not None:
                measured["first request to the pod that joined"] = first - fault.start
    if fault.kind in ("picker-kill", "envoy-restart"):
        # Routed by the picker again: the first request after the fix that took the picked route.
        again = _first(
            o.result.t0 for o in outcomes if o.result.t0 >= fault.end and (o.envoy or {}).get("route") == "picked"
        )
        if again is not None:
            measured["picked again"] = again - fault.start
    # The window: the last request the fault cost, not counting fail-open's model-blind 404s (a price of
    # fail-open for as long as the picker is away, not a delay of a mechanism).
    explained = [o for o in outcomes if o.fault is fault and not o.note.startswith("fail-open")]
    if explained:
        measured["window"] = max(0.0, max(o.result.t0 for o in explained) - fault.start)
    return measured


# What each kind's window is, in the words of the table's explanations.
_WINDOW_MEANS = {
    "pod-kill": "until the picker's next scrape was refused",
    "picker-kill": "until Envoy took the picker out (fail-open: at its first refused connection)",
    "envoy-restart": "while Envoy was down",
    "pool-churn": "until the picker heard the pod had left",
    "watch-drop": "until the picker watched again and heard the pod had left",
}


def _window_means(kind: str, fail_closed: bool) -> str:
    if kind == "picker-kill" and fail_closed:
        return "until the picker was back and Envoy's health check saw it (fail-closed)"
    return _WINDOW_MEANS.get(kind, "")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.0f} ms"


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def print_report(report: Report) -> None:
    args = report.args
    outcomes = report.outcomes
    total = len(outcomes)
    ok = sum(1 for o in outcomes if not o.bad)
    lost = [o for o in outcomes if o.lost is not None]
    misrouted = [o for o in outcomes if o.misrouted is not None]
    mode = "fail-closed" if args.fail_closed else "fail-open"
    print()
    print(
        f"chaos: {args.minutes:g} min, Envoy {mode}, picker in Kubernetes mode (fake API server), "
        f"{sum(s.in_pool for s in LAYOUT)} pods in the pool + 1 standby (simulated vLLM)"
    )
    print(
        f"requests: {total:,} ({total / max(report.duration, 1e-9):.1f}/s); answered as expected {ok:,}; "
        f"lost {len(lost)}; misrouted {len(misrouted)}; explained by a fault: "
        f"{sum(1 for o in outcomes if o.bad and o.fault)}; UNEXPLAINED: {len(report.unexplained)}"
    )
    print(
        "  lost = no answer, a connection error, a cut stream or an unexpected status; misrouted = received by a pod "
        "not in the pool, stale in the picker's view, or not serving the model (pods record every request id)"
    )
    print()
    header = (
        f"{'fault':<16}{'times':>6}{'lost':>6}{'in flight':>10}{'misrouted':>10}"
        f"{'window median':>15}{'max':>9}{'bound':>9}  measured (medians, seconds after the fault)"
    )
    print(header)
    print("-" * len(header))
    kinds = list(dict.fromkeys(f.kind for f in report.faults))
    for kind in kinds:
        faults = [f for f in report.faults if f.kind == kind]
        explained = [o for f in faults for o in report.per_fault.get(id(f), [])]
        in_flight = sum(1 for o in explained if o.fault and o.result.t0 < o.fault.start)
        windows = [report.measured[id(f)]["window"] for f in faults if "window" in report.measured[id(f)]]
        keys = list(dict.fromkeys(k for f in faults for k in report.measured[id(f)] if k != "window"))
        moments = "; ".join(
            f"{k} {_median([report.measured[id(f)][k] for f in faults if k in report.measured[id(f)]]):.2f}"
            for k in keys
        )
        bounds = [deadline(report.evidence, f) - f.start for f in faults]
        bound = None if kind.startswith("metrics") else _median(bounds)
        print(
            f"{kind:<16}{len(faults):>6}{sum(1 for o in explained if o.lost):>6}{in_flight:>10}"
            f"{sum(1 for o in explained if o.misrouted):>10}{_ms(_median(windows)):>15}"
            f"{_ms(max(windows) if windows else None):>9}{_ms(bound) if bound else 'none':>9}  {moments}"
        )
    print()
    print("window: from the fault to the start of the last request it cost (0: only requests already in flight);")
    print("bound: how long the mechanism that handles the fault may take (module docstring); 'none': nothing")
    print("may be lost or misrouted at all (a pod with a broken metrics page still serves).")
    for kind in kinds:
        faults = [f for f in report.faults if f.kind == kind]
        explained = [o for f in faults for o in report.per_fault.get(id(f), [])]
        if not explained:
            print(f"  {kind}: nothing lost or misrouted in {len(faults)} faults.")
            continue
        why = Counter((o.lost or o.misrouted or "") for o in explained)
        windows = [report.measured[id(f)].get("window", 0.0) for f in faults]
        print(
            f"  {kind}: {len(explained)} requests in {len(faults)} faults ("
            + ", ".join(f"{n} {reason}" for reason, n in why.most_common())
            + f"), the last sent {_ms(max(windows))} after the fault at most, {_window_means(kind, args.fail_closed)}."
        )
    if report.unexplained:
        print()
        print(f"UNEXPLAINED ({len(report.unexplained)}): lost or misrouted outside every fault's window")
        for o in report.unexplained[:40]:
            print("  " + o.describe().replace(f"t0={o.result.t0:.3f}", f"t={o.result.t0 - report.t0:.2f}s"))
    print()
    print(f"{'process':<16}{'RSS MiB: start':>15}{'max':>8}{'end':>8}{'fds: start':>12}{'max':>6}{'end':>6}")
    for label, pick in (
        ("picker (main)", lambda s: s.picker),
        ("scrape worker", lambda s: s.worker),
        ("envoy", lambda s: s.envoy),
    ):
        values = [v for v in (pick(s) for s in report.evidence.samples) if v is not None]
        if not values:
            continue
        rss = [v[0] / 2**20 for v in values]
        fds = [v[1] for v in values]
        print(f"{label:<16}{rss[0]:>15.1f}{max(rss):>8.1f}{rss[-1]:>8.1f}{fds[0]:>12}{max(fds):>6}{fds[-1]:>6}")
    connections = [s.envoy_connections for s in report.evidence.samples if s.envoy_connections is not None]
    if connections:
        print(
            f"envoy connections: from clients {min(c[0] for c in connections)}..{max(c[0] for c in connections)}, "
            f"to pods and the picker {min(c[1] for c in connections)}..{max(c[1] for c in connections)} "
            "(Envoy's fds follow them: connection pools, not a leak, when the two move together)"
        )
    print("  (the picker's and Envoy's numbers start again at each of their restarts)")
    print(f"scrape workers still running after their picker was SIGKILLed: {len(report.evidence.orphans)}")
    print(
        f"requests received by a pod twice: {len(report.duplicates)}; "
        f"arrivals the client skipped: {report.evidence.skipped}"
    )
    levels: Counter[str] = Counter()
    for (level, _), n in report.problems.items():
        levels[level] += n
    print("picker log (all its lives): " + (", ".join(f"{n} {level}" for level, n in levels.items()) or "no warnings"))
    worst_first = sorted(report.problems.items(), key=lambda item: (item[0][0] == "WARNING", -item[1]))
    for (level, message), n in worst_first[:12]:
        print(f"  {n:>5} {level:<8} {message}")


def plot(report: Report, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display here
    import matplotlib.pyplot as plt

    t0 = report.t0
    end = max((o.result.t1 for o in report.outcomes), default=t0) - t0
    seconds = int(end) + 1
    good = [0] * seconds
    kinds = ("connection", "cut", "5xx", "404 fail-open round robin", "other status", "misrouted")
    bad = {k: [0] * seconds for k in kinds}
    for o in report.outcomes:
        second = min(seconds - 1, max(0, int(o.result.t0 - t0)))
        if not o.bad:
            good[second] += 1
            continue
        if o.misrouted:
            kind = "misrouted"
        elif o.lost in ("connect refused", "disconnected", "timeout"):
            kind = "connection"
        elif o.lost in ("answer cut", "stream incomplete"):
            kind = "cut"
        elif o.lost and o.lost.startswith("status 5"):
            kind = "5xx"
        elif o.note.startswith("fail-open"):
            kind = "404 fail-open round robin"
        else:
            kind = "other status"
        bad[kind][second] += 1
    figure, (top, errors, rss, fds) = plt.subplots(4, 1, sharex=True, figsize=(14, 10))
    xs = list(range(seconds))
    top.plot(xs, good, lw=0.6, color="tab:green")
    top.set_ylabel("answered/s")
    bottom = [0] * seconds
    colors = {
        "connection": "tab:red",
        "cut": "tab:orange",
        "5xx": "tab:purple",
        "404 fail-open round robin": "tab:olive",
        "other status": "tab:brown",
        "misrouted": "tab:blue",
    }
    for kind in kinds:
        if any(bad[kind]):
            errors.bar(xs, bad[kind], bottom=bottom, width=1.0, color=colors[kind], label=kind)
            bottom = [a + b for a, b in zip(bottom, bad[kind], strict=True)]
    errors.set_ylabel("lost or misrouted/s")
    if any(bottom):
        errors.legend(loc="upper right", fontsize=7)
    for label, pick, color in (
        ("picker", lambda s: s.picker, "tab:blue"),
        ("scrape worker", lambda s: s.worker, "tab:cyan"),
        ("envoy", lambda s: s.envoy, "tab:gray"),
    ):
        points = [(s.t - t0, pick(s)) for s in report.evidence.samples if pick(s) is not None]
        rss.plot([p[0] for p in points], [p[1][0] / 2**20 for p in points], ".", ms=2, label=label, color=color)
        fds.plot([p[0] for p in points], [p[1][1] for p in points], ".", ms=2, label=label, color=color)
    links = [(s.t - t0, s.envoy_connections) for s in report.evidence.samples if s.envoy_connections is not None]
    if links:
        fds.plot(
            [p[0] for p in links],
            [sum(p[1]) for p in links],
            "-",
            lw=0.6,
            color="tab:olive",
            label="envoy connections (clients + upstreams)",
        )
    rss.set_ylabel("RSS MiB")
    fds.set_ylabel("open fds")
    rss.legend(loc="upper right", fontsize=7)
    fds.legend(loc="upper right", fontsize=7)
    fds.set_xlabel("seconds")
    palette = plt.get_cmap("tab10")
    spans = sorted({f.kind for f in report.faults})
    for axis in (top, errors, rss, fds):
        for fault in report.faults:
            shade = palette(spans.index(fault.kind) % 10)
            axis.axvspan(fault.start - t0, max(fault.end, fault.start + 0.5) - t0, color=shade, alpha=0.2, lw=0)
    handles = [plt.Rectangle((0, 0), 1, 1, color=palette(i % 10), alpha=0.3) for i in range(len(spans))]
    top.legend(handles, spans, loc="upper right", fontsize=7, ncol=3)
    mode = "fail-closed" if report.args.fail_closed else "fail-open"
    top.set_title(
        f"chaos: {report.args.minutes:g} min, {mode}; {len(report.outcomes):,} requests, "
        f"{len(report.unexplained)} unexplained losses or misroutes"
    )
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=90)
    plt.close(figure)


async def collect(args: argparse.Namespace, kinds: list[str]) -> Evidence:
    """Run the pool, the load and the faults for ``args.minutes``; what happened, saved in a work directory."""
    workdir = Path(tempfile.mkdtemp(prefix="epp-chaos-"))
    bench = Bench(args, workdir)
    print(f"starting: {len(LAYOUT)} simulated pods, the fake API server, the picker, Envoy (work dir {workdir})")
    load = Load(bench.url, args.rate, args.max_in_flight, args.seed, f"r{os.getpid()}")
    try:
        await bench.start()
        bench.t0 = time.time()
        deadline = bench.t0 + args.minutes * 60
        mode = "fail-closed" if args.fail_closed else "fail-open"
        print(f"traffic for {args.minutes:g} min at {args.rate:g} requests/s, Envoy {mode}; faults:", flush=True)
        await asyncio.gather(
            load.run_until(deadline),
            bench.run_faults(kinds, deadline),
            bench.sample_processes(deadline),
            bench.watch_picker_view(deadline),
        )
    finally:
        await bench.stop()
    evidence = bench.evidence(load)
    evidence.save()
    return evidence


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=30.0, help="how long the traffic runs")
    parser.add_argument("--rate", type=float, default=30.0, help="requests per second (Poisson arrivals)")
    parser.add_argument("--max-in-flight", type=int, default=200, help="the client's bound on open requests")
    parser.add_argument("--faults", default=",".join(FAULT_KINDS), help="fault kinds, injected in turn, cycling")
    parser.add_argument("--hold", type=float, default=5.0, help="seconds each fault lasts")
    parser.add_argument("--gap", type=float, default=12.0, help="quiet seconds after each fault (and at the start)")
    parser.add_argument("--fail-closed", action="store_true", help="Envoy fail-closed (default: fail-open)")
    parser.add_argument("--time-scale", type=float, default=0.5, help="the simulated pods' --time-scale")
    parser.add_argument("--staleness", type=float, default=2.0, help="the picker's --metrics-staleness-threshold")
    parser.add_argument("--picker-arg", action="append", default=[], help="an extra flag for the picker")
    parser.add_argument("--sample-interval", type=float, default=1.0, help="seconds between RSS/fd samples")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--png", default=str(_RESULTS / "chaos.png"), help="the timeline ('' for none)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (the evidence) after the run")
    parser.add_argument("--reanalyse", metavar="DIR", help="analyse the evidence a --keep run left in DIR again")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.reanalyse:
        evidence = Evidence.load(Path(args.reanalyse))
    else:
        kinds = [k.strip() for k in args.faults.split(",") if k.strip()]
        unknown = [k for k in kinds if k not in FAULT_KINDS]
        if unknown:
            print(f"unknown fault kind(s) {', '.join(unknown)}; known: {', '.join(FAULT_KINDS)}", file=sys.stderr)
            return 2
        evidence = asyncio.run(collect(args, kinds))
    report = analyse(evidence)
    report.print()
    if args.png:
        plot(report, args.png)
        print(f"timeline: {args.png}")
    if args.keep or args.reanalyse:
        print(f"evidence: {evidence.workdir} (python bench/chaos.py --reanalyse {evidence.workdir})")
    else:
        shutil.rmtree(evidence.workdir, ignore_errors=True)
    return 1 if report.unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
