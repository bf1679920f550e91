"""Overload: twice the pool's capacity, 20% interactive and 80% batch, with and without flow control.

What it shows: under overload a gateway that forwards everything moves the queue onto the model
servers, where interactive requests wait behind batch ones; the picker's flow control keeps the
queue in the picker, serves interactive requests first and sheds batch ones when their queue
budget runs out.

Setup (all on 127.0.0.1, each mode on fresh processes): simulated vLLM pods in a child process
(``python -m epp.sim``), a real Envoy, and for the picker modes the picker as a child process
(``python -m epp serve``, scraping the pods every 50 ms in its scrape worker). The load generator
in this process sends an open-loop Poisson stream (the same seeded schedule for every mode) at
``--overload`` x the pool's capacity; interactive requests (header
``x-gateway-inference-objective: interactive``) stream their answer, so their time to first token
is measured; batch ones (``...: batch``) do not. Every request asks for ``--output-tokens`` tokens
(``ignore_eos``), so the capacity is known from the simulator's cost model (printed).

Modes:

* ``round-robin``: Envoy alone (no ext_proc), round robin over the pods;
* ``picker``: the picker, default scheduling, no objectives configured: every request has
  priority 0, nothing is refused (upstream's default with no InferenceObjectives);
* ``picker+shedding``: objectives ``interactive`` (10) and ``batch`` (-1), flow control off:
  upstream's legacy admission refuses batch (sheddable) requests with 429 while saturated;
* ``flow-control``: the same objectives with the ``flowControl`` gate on, ``defaultRequestTTL``
  ``--batch-ttl``: requests wait in the picker while the pool is saturated (the default
  ``utilization-detector``), highest priority first; a request still queued after the TTL gets 503.

The machine has 2 cores shared with everything else; the simulator's ``--time-scale`` (default 4:
every simulated step takes four times as long) keeps the request rate low enough (~35 req/s at 2x)
that the generator, Envoy and the picker are not what limits throughput. The table's last column
says how late the generator launched requests against their schedule (P99), as a check.

Run: ``python bench/overload.py`` (about 3 minutes: 4 modes x (25 s of load + up to 12 s to drain
+ start-up)). Requests still unanswered when the drain time ends are counted as incomplete; an
unanswered interactive request enters the TTFT percentiles with the time it had waited so far (a
lower bound, marked ``>=``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field

import aiohttp

from epp.envoy.bootstrap import BootstrapOptions, render, render_round_robin
from epp.scheduling.config import DEFAULT_CONFIG
from epp.sim.config import EngineConfig
from epp.testing.envoy import EnvoyProcess
from epp.testing.harness import PickerProcess, wait_for_picker

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
MODES = ("round-robin", "picker", "picker+shedding", "flow-control")
OBJECTIVES = """
inferenceObjectives:
- name: interactive
  priority: 10
- name: batch
  priority: -1
"""
# The filler after each request's unique head: ~50 tokens, no prefix shared between requests.
FILLER = "please summarise the following notes about the quarterly planning meeting in detail " * 2


@dataclass(frozen=True)
class Scenario:
    pods: int
    max_num_seqs: int
    time_scale: float
    output_tokens: int
    overload: float
    interactive_share: float
    duration: float
    drain: float
    batch_ttl: str
    seed: int

    def engine(self) -> EngineConfig:
        return EngineConfig(max_num_seqs=self.max_num_seqs, time_scale=self.time_scale)

    def capacity(self) -> float:
        """Requests/s the pool completes when every pod runs ``max_num_seqs`` at once (the
        simulator's cost model, in wall seconds)."""
        cfg = self.engine()
        prompt = len(FILLER) / 4 + 4
        context = prompt + self.output_tokens / 2  # average tokens of KV each sequence reads per step
        step = cfg.step_base_s + self.max_num_seqs * (cfg.decode_seq_s + cfg.kv_read_token_s * context)
        per_request = (self.output_tokens * step + prompt * cfg.prefill_token_s) * cfg.time_scale
        return self.pods * self.max_num_seqs / per_request

    def rate(self) -> float:
        return self.overload * self.capacity()


def config_for(mode: str, scenario: Scenario) -> str | None:
    if mode == "round-robin":
        return None
    if mode == "picker":
        return DEFAULT_CONFIG
    if mode == "picker+shedding":
        return DEFAULT_CONFIG + OBJECTIVES
    return DEFAULT_CONFIG + OBJECTIVES + f"featureGates: [flowControl]\nflowControl:\n  defaultRequestTTL: {scenario.batch_ttl}\n"


@dataclass
class Outcome:
    kind: str  # interactive | batch
    scheduled: float  # seconds after the start
    launched: float = math.nan
    status: int = 0  # 0: no answer (incomplete, or a transport error)
    ttft: float = math.nan  # interactive: seconds from the scheduled send to the first token
    error: str = ""


@dataclass
class Result:
    mode: str
    outcomes: list[Outcome] = field(default_factory=list)
    elapsed: float = 0.0


def schedule(scenario: Scenario) -> list[tuple[float, str]]:
    """(send time, kind): Poisson arrivals at the scenario's rate, the same for every mode."""
    rng = random.Random(scenario.seed)
    rate, t, plan = scenario.rate(), 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= scenario.duration:
            return plan
        plan.append((t, "interactive" if rng.random() < scenario.interactive_share else "batch"))


async def one_request(session: aiohttp.ClientSession, url: str, index: int, outcome: Outcome, start: float, scenario: Scenario) -> None:
    stream = outcome.kind == "interactive"
    body = {
        "model": MODEL,
        "prompt": f"{index} {outcome.kind}: {FILLER}",
        "max_tokens": scenario.output_tokens,
        "ignore_eos": True,
        "stream": stream,
    }
    headers = {"content-type": "application/json", "x-gateway-inference-objective": outcome.kind}
    outcome.launched = time.monotonic() - start
    try:
        async with session.post(url, data=json.dumps(body), headers=headers) as response:
            if response.status != 200 or not stream:
                await response.read()
                outcome.status = response.status
                return
            async for line in response.content:
                if line.startswith(b"data: ") and math.isnan(outcome.ttft):
                    outcome.ttft = time.monotonic() - start - outcome.scheduled
            outcome.status = response.status
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # a transport failure: counted, never fatal to the run
        outcome.error = type(exc).__name__


async def drive(url: str, scenario: Scenario) -> Result:
    result = Result(mode="")
    plan = schedule(scenario)
    connector = aiohttp.TCPConnector(limit=0)  # the queue must form where it would in production, not here
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        start = time.monotonic()
        tasks = []
        for index, (at, kind) in enumerate(plan):
            delay = start + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            outcome = Outcome(kind=kind, scheduled=at)
            result.outcomes.append(outcome)
            tasks.append(asyncio.ensure_future(one_request(session, url, index, outcome, start, scenario)))
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, start + scenario.duration + scenario.drain - time.monotonic()))
        result.elapsed = time.monotonic() - start
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    for outcome in result.outcomes:  # unanswered interactive: the wait so far is a lower bound of its TTFT
        if outcome.kind == "interactive" and outcome.status == 0 and not outcome.error and math.isnan(outcome.ttft):
            outcome.ttft = -(result.elapsed - outcome.scheduled)  # negative: censored
    return result


def start_pods(scenario: Scenario) -> tuple[subprocess.Popen[str], list[str]]:
    process = subprocess.Popen(
        [
            sys.executable, "-m", "epp.sim",
            "--pods", str(scenario.pods),
            "--max-num-seqs", str(scenario.max_num_seqs),
            "--time-scale", str(scenario.time_scale),
            "--seed", str(scenario.seed),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert process.stdout is not None
    hostports = [process.stdout.readline().split()[1].removeprefix("http://") for _ in range(scenario.pods)]
    return process, hostports


def run_mode(mode: str, scenario: Scenario) -> Result:
    pods, hostports = start_pods(scenario)
    picker: PickerProcess | None = None
    envoy: EnvoyProcess | None = None
    try:
        options = BootstrapOptions(listen_address="127.0.0.1", listen_port=0, admin_port=0, pool_endpoints=tuple(hostports))
        text = config_for(mode, scenario)
        if text is None:
            envoy = EnvoyProcess(render_round_robin(options), concurrency=1)
            envoy.start()
        else:
            picker = PickerProcess(hostports, extra_args=["--config-text", text])
            picker.start()
            options = BootstrapOptions(
                listen_address="127.0.0.1", listen_port=0, admin_port=0, picker_port=picker.grpc_port, pool_endpoints=tuple(hostports)
            )
            envoy = EnvoyProcess(render(options), concurrency=1)
            envoy.start()
            wait_for_picker(envoy)
            time.sleep(0.5)  # a few scrapes: the picker knows the pods before the load starts
        result = asyncio.run(drive(f"http://127.0.0.1:{envoy.listen_port}/v1/completions", scenario))
        result.mode = mode
        return result
    finally:
        if envoy is not None:
            envoy.stop()
        if picker is not None:
            picker.stop()
        pods.terminate()
        pods.wait(10)


# --- the table ---------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def ttft_cell(ttfts: list[float], q: float) -> tuple[str, float]:
    """The q-quantile of TTFTs (censored ones are negative: their magnitude is a lower bound)."""
    if not ttfts:
        return "-", math.nan
    value = percentile([abs(t) for t in ttfts], q)
    censored = any(t < 0 and abs(t) <= value for t in ttfts) and any(t < 0 for t in ttfts)
    return (f">={value:.2f}" if censored else f"{value:.2f}"), value


@dataclass
class Row:
    mode: str
    interactive: int
    batch: int
    p50: str
    p99: str
    p99_value: float
    interactive_shed: int
    batch_done: float
    shed_429: int
    shed_503: int
    incomplete: int
    errors: int
    launch_lag_p99_ms: float


def summarise(result: Result) -> Row:
    interactive = [o for o in result.outcomes if o.kind == "interactive"]
    batch = [o for o in result.outcomes if o.kind == "batch"]
    ttfts = [o.ttft for o in interactive if not math.isnan(o.ttft)]
    p50, _ = ttft_cell(ttfts, 0.50)
    p99, p99_value = ttft_cell(ttfts, 0.99)
    lags = [max(0.0, o.launched - o.scheduled) for o in result.outcomes if not math.isnan(o.launched)]
    return Row(
        mode=result.mode,
        interactive=len(interactive),
        batch=len(batch),
        p50=p50,
        p99=p99,
        p99_value=p99_value,
        interactive_shed=sum(1 for o in interactive if o.status in (429, 503)),
        batch_done=sum(1 for o in batch if o.status == 200) / max(1, len(batch)),
        shed_429=sum(1 for o in result.outcomes if o.status == 429),
        shed_503=sum(1 for o in result.outcomes if o.status == 503),
        incomplete=sum(1 for o in result.outcomes if o.status == 0 and not o.error),
        errors=sum(1 for o in result.outcomes if o.error or o.status not in (0, 200, 429, 503)),
        launch_lag_p99_ms=percentile(lags, 0.99) * 1e3 if lags else math.nan,
    )


def print_table(rows: list[Row], scenario: Scenario) -> None:
    print(
        f"\n{scenario.pods} simulated pods (max_num_seqs {scenario.max_num_seqs}, time scale {scenario.time_scale:g}, "
        f"{scenario.output_tokens} output tokens): capacity ~{scenario.capacity():.1f} req/s; offered "
        f"{scenario.overload:g}x = {scenario.rate():.1f} req/s for {scenario.duration:g} s "
        f"({scenario.interactive_share:.0%} interactive), drain <= {scenario.drain:g} s\n"
    )
    header = (
        "mode", "sent int/batch", "int TTFT P50 s", "int TTFT P99 s", "int shed", "batch done",
        "shed 429/503", "incomplete", "errors", "launch lag P99 ms",
    )  # fmt: skip
    lines = [
        (
            r.mode, f"{r.interactive}/{r.batch}", r.p50, r.p99, str(r.interactive_shed), f"{r.batch_done:.0%}",
            f"{r.shed_429}/{r.shed_503}", str(r.incomplete), str(r.errors), f"{r.launch_lag_p99_ms:.1f}",
        )
        for r in rows
    ]
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    print(" | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    print("-+-".join("-" * w for w in widths))
    for line in lines:
        print(" | ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)))
    by_mode = {r.mode: r for r in rows}
    flow, plain = by_mode.get("flow-control"), by_mode.get("picker")
    if flow and plain and plain.p99_value > 0:
        ratio = flow.p99_value / plain.p99_value
        verdict = "met" if ratio <= 0.25 and flow.interactive_shed == 0 else "NOT met"
        print(
            f"\ninteractive TTFT P99, flow control / picker without it: {ratio:.3f} "
            f"(target <= 0.25 with no interactive request shed: {verdict}; "
            f"interactive shed with flow control: {flow.interactive_shed})"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES)}")
    parser.add_argument("--pods", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=8, help="concurrent requests per simulated pod")
    parser.add_argument("--time-scale", type=float, default=4.0, help="simulator wall seconds per simulated second")
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--overload", type=float, default=2.0, help="offered load as a multiple of the pool's capacity")
    parser.add_argument("--interactive-share", type=float, default=0.2)
    parser.add_argument("--duration", type=float, default=25.0, help="seconds of load per mode")
    parser.add_argument("--drain", type=float, default=12.0, help="seconds to wait for answers after the load stops")
    parser.add_argument("--batch-ttl", default="10s", help="flow control's defaultRequestTTL (a Go duration)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"unknown mode(s) {unknown}; known: {', '.join(MODES)}")
    scenario = Scenario(
        pods=args.pods,
        max_num_seqs=args.max_num_seqs,
        time_scale=args.time_scale,
        output_tokens=args.output_tokens,
        overload=args.overload,
        interactive_share=args.interactive_share,
        duration=args.duration,
        drain=args.drain,
        batch_ttl=args.batch_ttl,
        seed=args.seed,
    )
    rows = []
    for mode in modes:
        print(f"running {mode} ...", file=sys.stderr, flush=True)
        rows.append(summarise(run_mode(mode, scenario)))
    print_table(rows, scenario)
    return 0


if __name__ == "__main__":
    sys.exit(main())
