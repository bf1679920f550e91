"""What model-server telemetry costs: the picker's scrape CPU at 8 and 100 pods, the pods' CPU answering
it, with the idle backoff on and off, and the effect of scraping on request latency.

Pods are stand-ins (``epp.testing.farm``), each on its own loopback address (127.0.1.i) as pods
have their own IPs: one process serves every pod's metrics port (full-size ~52 KB vLLM pages
rendered by the simulator, pre-built bytes, at the lowest CPU priority: remote pods take no CPU
from the picker), another every pod's serving port (tiny JSON completions, normal priority). The
picker scrapes the metrics port (``--model-server-metrics-port``) every 50 ms (upstream default).

Part 1, cost. For each pool size (``--pods``, default 8 and 100), in rounds that alternate the modes
(default 3 rounds; medians printed, and each round's total): the picker with its defaults
(``backoff``: idle pods asked up to 1 s apart), with ``--refresh-metrics-idle-interval=0`` (``no
backoff``: every pod every 50 ms, as upstream), with scraping off (its own idle, which the ``cost``
column subtracts), and with ``--baseline DIR`` a picker run from another checkout's ``epp`` package
(the code before a change; e.g. ``git archive REV epp plugins | tar -x -C DIR``, then copy the built
``epp/prefix/_native*.so`` into ``DIR/epp/prefix/`` and ``ln -s ../plugins DIR/epp/plugins``). Per
mode: the picker's CPU over a window (user + system from /proc, all threads, the scrape worker
process included) divided by the window = cores, the request-path process's share alone, the scrape
rate achieved (the picker's own ``epp_endpoint_scrapes_total``), and the farm's CPU per pod per
second (the stand-in pods' cost of answering; /proc's 10 ms clock ticks bound its resolution: ~0.1
ms/s per pod at 8 pods over 10 s). By default the pods are idle: each serves the same page every
scrape (``--idle`` of the farm), as an idle vLLM pod does; with ``--busy`` each scrape gets another
page (gauges drawn at random), which the backoff never slows. A picker is given ``--settle`` seconds
(4) before its window: a steady pod reaches the 1 s gap ~1.7 s after its numbers stop changing.

Part 2, request path. Envoy + picker in front of the 100 pods, wrk offering ~500 req/s (an
exponential pause per connection), the picker with scraping on and then off, alternating rounds;
P50/P99 and the achieved rate per run, medians per mode, and the P99 difference.

Run: ``python bench/scrape_cost.py`` (needs wrk; ``--skip-latency`` for part 1 alone). Talks only to
127.0.0.1; bounded in time.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from epp.envoy.bootstrap import BootstrapOptions, render
from epp.testing.envoy import EnvoyProcess
from epp.testing.harness import PickerProcess, cpu_seconds, wait_for_picker

_RATE_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model": "meta-llama/Llama-3.1-8B-Instruct", "prompt": "How far is the moon?", "max_tokens": 8}'
local pause = tonumber(os.getenv("EPP_BENCH_DELAY_MS"))
-- Exponential pauses (mean `pause`): connections drift apart instead of firing in lockstep, so the
-- offered load is close to Poisson arrivals rather than bursts of one request per connection.
function delay()
  return -math.log(1 - math.random()) * pause
end
"""


# Each pod gets its own loopback address, as pods in a cluster get their own IPs: one farm process
# serves every pod's metrics port, another every pod's serving port, so serving metrics pages
# cannot slow down the answers to requests (or the other way round).
_HOSTS = "127.0.1."
_SERVING_PORT = 28000
_METRICS_PORT = 29000


def start_farm(
    pods: int, port: int, *, background: bool, idle: bool = False
) -> tuple[subprocess.Popen[str], list[str], int]:
    """A farm process for ``pods`` pods on ``port``; ``background``: at a low CPU priority (``--farm-nice``);
    ``idle``: every pod serves the same page every time (``--idle``), as an idle vLLM pod does.

    The metrics farm stands in for pods on other machines: in the background it takes only what
    the picker, Envoy and wrk leave, as remote pods would take nothing from them. On a machine
    shared with other work, nice 19 can starve it past the scrape timeout (the scrapes/s column
    falls short of the target, and the cost then includes timeouts and reconnects): measure the
    CPU cost with a smaller niceness then; the picker's CPU time does not include the farm's.
    """
    process = subprocess.Popen(
        [
            sys.executable, "-m", "epp.testing.farm", "--pods", str(pods), "--host-prefix", _HOSTS,
            "--port", str(port), *(["--idle"] if idle else []),
        ],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=(lambda: os.nice(_FARM_NICE[0])) if background else None,
    )  # fmt: skip
    assert process.stdout is not None
    page_bytes = int(process.stdout.readline().split()[1])
    hostports = [process.stdout.readline().split()[1] for _ in range(pods)]
    return process, hostports, page_bytes


_FARM_NICE = [19]  # --farm-nice
_EXTRA_ARGS: list[str] = []
_WRK_PREFIX: list[str] = []  # ["taskset", "-c", "1"] with --pin


def _picker(pods: int, scraping: bool, extra: Sequence[str] = (), *, source: str | None = None) -> PickerProcess:
    """A picker in front of the farm's pods; ``source``: the ``epp`` package of another checkout (its
    parent directory, put first on PYTHONPATH for the picker and its scrape worker)."""
    endpoints = [f"{_HOSTS}{i + 1}:{_SERVING_PORT}" for i in range(pods)]
    picker = PickerProcess(
        endpoints,
        extra_args=[
            f"--scrape-metrics={'true' if scraping else 'false'}",
            "--model-server-metrics-port", str(_METRICS_PORT),
            *_EXTRA_ARGS,
            *extra,
        ],
    )  # fmt: skip
    if source is not None:
        # env execs the picker (the same PID); PYTHONSAFEPATH: not the working directory's epp/ before it.
        picker.args[:0] = ["env", f"PYTHONPATH={source}", "PYTHONSAFEPATH=1"]
    return picker


def scrapes_done(picker: PickerProcess) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{picker.metrics_port}/metrics", timeout=5).read().decode()
    match = re.search(r"^epp_endpoint_scrapes_total (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


# The modes of the cost part, alternated in every round: the picker's extra flags.
MODES: dict[str, list[str]] = {
    "backoff": [],  # the default: --refresh-metrics-idle-interval=1s
    "no backoff": ["--refresh-metrics-idle-interval=0"],  # every pod every 50 ms, as upstream
    "scraping off": [],  # the picker's own idle, read against the others
}


def measure_cost(
    pods: int, window: float, rounds: int, *, idle: bool, settle: float, modes: Sequence[str], baseline: str | None
) -> tuple[int, dict[str, list[dict[str, float]]]]:
    """The page size, and per mode (of :data:`MODES`, and ``baseline``: the picker of another checkout
    with its defaults; alternating in each round) one entry per round: the picker's cores (with its
    scrape worker, and the request-path process alone), scrapes per second, and the farm's CPU per
    pod per second (the stand-in pods' cost of answering)."""
    farm, _, page_bytes = start_farm(pods, _METRICS_PORT, background=True, idle=idle)
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in [*(["baseline"] if baseline else []), *modes]}
    try:
        for _ in range(rounds):
            for mode in runs:
                if mode == "baseline":
                    picker = _picker(pods, True, source=baseline)
                else:
                    picker = _picker(pods, mode != "scraping off", MODES[mode])
                picker.start()
                try:
                    time.sleep(settle)  # connections open, first pages parsed, idle pods backed off
                    total0, main0 = cpu_seconds(picker.pid), cpu_seconds(picker.pid, children=False)
                    farm0, scrapes0, t0 = cpu_seconds(farm.pid), scrapes_done(picker), time.monotonic()
                    time.sleep(window)
                    total1, main1 = cpu_seconds(picker.pid), cpu_seconds(picker.pid, children=False)
                    farm1, scrapes1, t1 = cpu_seconds(farm.pid), scrapes_done(picker), time.monotonic()
                finally:
                    picker.stop()
                elapsed = t1 - t0
                runs[mode].append({
                    "cores": (total1 - total0) / elapsed,
                    "main_cores": (main1 - main0) / elapsed,
                    "scrapes_per_s": (scrapes1 - scrapes0) / elapsed,
                    "pod_ms_per_s": (farm1 - farm0) * 1000 / elapsed / pods,
                })  # fmt: skip
    finally:
        _end(farm)
    return page_bytes, runs


def _end(process: subprocess.Popen[str]) -> None:
    process.terminate()
    try:
        process.wait(30)  # a farm at nice 19 on a busy machine may take a while to get the CPU to exit
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _pin(pids: list[int], cpus: set[int]) -> None:
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():  # every thread, not only the main one
            os.sched_setaffinity(int(task.name), cpus)


def _children(pid: int) -> list[int]:
    return [int(c) for listing in Path(f"/proc/{pid}/task").glob("*/children") for c in listing.read_text().split()]


def measure_latency(
    pods: int, rate: int, connections: int, duration: int, rounds: int, *, pin: bool = False
) -> dict[str, list[dict[str, float]]]:
    farm, _, _ = start_farm(pods, _METRICS_PORT, background=True)
    serving, _, _ = start_farm(pods, _SERVING_PORT, background=False)
    if pin:
        _pin([farm.pid, serving.pid], {1})
    work = Path(tempfile.mkdtemp(prefix="epp-scrape-bench-"))
    script = work / "rate.lua"
    script.write_text(_RATE_SCRIPT)
    results: dict[str, list[dict[str, float]]] = {"scraping on": [], "scraping off": []}
    try:
        for _ in range(rounds):
            for mode in results:
                picker = _picker(pods, mode == "scraping on")
                picker.start()
                options = BootstrapOptions(
                    listen_address="127.0.0.1", listen_port=0, admin_port=0, picker_port=picker.grpc_port
                )
                envoy = EnvoyProcess(render(options), concurrency=1)
                try:
                    envoy.start()
                    if pin:
                        # The request-path process gets CPU 0 to itself; everything else shares CPU 1.
                        _pin([picker.pid], {0})
                        _pin([envoy.pid, *_children(picker.pid)], {1})
                    wait_for_picker(envoy)
                    time.sleep(1.0)
                    # Each connection sends, waits for the answer, then pauses: pause = connections/rate
                    # less a typical answer time (~2 ms) so the offered rate lands near `rate`.
                    delay_ms = max(0.0, connections * 1000.0 / rate - 2.0)
                    url = f"http://127.0.0.1:{envoy.listen_port}/v1/completions"
                    out = _run_rate(url, script, connections, duration, delay_ms)
                    results[mode].append(out)
                finally:
                    envoy.stop()
                    picker.stop()
        return results
    finally:
        for process in (farm, serving):
            _end(process)


def _run_rate(url: str, script: Path, connections: int, duration: int, delay_ms: float) -> dict[str, float]:
    output = subprocess.run(
        [*_WRK_PREFIX, "wrk", "-t1", f"-c{connections}", f"-d{duration}s", "--latency", "-s", str(script), url],
        env={"EPP_BENCH_DELAY_MS": f"{delay_ms:.2f}", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
        timeout=duration + 60,
    ).stdout
    units = {"us": 1e-3, "ms": 1.0, "s": 1e3}

    def ms(text: str) -> float:
        number, unit = _match(r"([\d.]+)([a-z]+)\Z", text).groups()
        return float(number) * units[unit]

    percentiles = dict(re.findall(r"^\s+(50|99)%\s+(\S+)$", output, re.M))
    errors = sum(int(n) for n in re.findall(r"Non-2xx or 3xx responses: (\d+)", output))
    return {
        "rps": float(_match(r"Requests/sec:\s+([\d.]+)", output).group(1)),
        "p50_ms": ms(percentiles["50"]),
        "p99_ms": ms(percentiles["99"]),
        "errors": errors,
    }


def _match(pattern: str, text: str) -> re.Match[str]:
    match = re.search(pattern, text)
    if match is None:
        raise RuntimeError(f"no {pattern!r} in wrk's output:\n{text}")
    return match


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", default="8,100", help="pool sizes for the cost part")
    parser.add_argument("--window", type=float, default=10.0, help="seconds of CPU measurement per pool size and mode")
    parser.add_argument("--rate", type=int, default=500, help="offered req/s for the latency part")
    parser.add_argument("--connections", type=int, default=10)
    parser.add_argument("--duration", type=int, default=10, help="seconds per latency run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-latency", action="store_true")
    parser.add_argument("--busy", action="store_true", help="cost part: pods serve a different page each scrape")
    parser.add_argument("--modes", default=",".join(MODES), help=f"cost part: a subset of {', '.join(MODES)}")
    parser.add_argument(
        "--idle-intervals",
        default="",
        metavar="D,D",
        help="cost part: also the backoff with these --refresh-metrics-idle-interval values (e.g. 250ms,500ms,2s)",
    )
    parser.add_argument(
        "--baseline",
        metavar="DIR",
        help="cost part: also a picker run from another checkout's epp package (DIR holds epp/), with its defaults",
    )
    parser.add_argument(
        "--settle", type=float, default=4.0, help="seconds from the picker's start to the window (backoff settles)"
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="scrape on the request path's event loop (--metrics-scraper-process=false)",
    )
    parser.add_argument(
        "--whole-pages", action="store_true", help="scrape whole pages (--model-server-metrics-name-filter=false)"
    )
    parser.add_argument(
        "--farm-nice",
        type=int,
        default=19,
        help="CPU niceness of the metrics farm (19: it never competes with the picker)",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="latency part: the picker's request process alone on CPU 0; scrape worker, Envoy, wrk and pods on CPU 1",
    )
    args = parser.parse_args(argv)
    modes = [mode.strip() for mode in args.modes.split(",") if mode.strip()]
    if unknown := set(modes) - set(MODES):
        parser.error(f"unknown --modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    for value in (v.strip() for v in args.idle_intervals.split(",") if v.strip()):
        MODES[f"backoff {value}"] = [f"--refresh-metrics-idle-interval={value}"]
        modes.insert(modes.index("scraping off") if "scraping off" in modes else len(modes), f"backoff {value}")
    _FARM_NICE[0] = args.farm_nice
    if args.in_process:
        _EXTRA_ARGS.append("--metrics-scraper-process=false")
    if args.whole_pages:
        _EXTRA_ARGS.append("--model-server-metrics-name-filter=false")
    if not args.skip_latency and shutil.which("wrk") is None:
        print("wrk is needed: apt-get install wrk", file=sys.stderr)
        return 2

    farm_kind = "busy pods (a different page each scrape)" if args.busy else "idle pods (the same page each scrape)"
    print(f"Scrape cost, {farm_kind}: picker CPU (cores) with scraping on, backoff on and off, and off")
    print("(total = the picker process and its scrape worker; main = the request-path process alone; cost = total")
    print(" above the same picker with scraping off; pod = the stand-in pods' CPU answering scrapes, per pod;")
    print(f" {args.rounds} alternating rounds of {args.window:g} s after {args.settle:g} s to settle, medians)")
    print(f"(options: {' '.join(_EXTRA_ARGS) or 'defaults: scrape worker process, ?name[]= filter'})\n")
    print(
        f"{'pods':>5} {'mode':<14} | {'total':>6} {'main':>6} {'cost':>6} | {'scrapes/s':>9} | {'us/scrape':>9} | "
        f"{'pod ms/s':>8} | total per round"
    )
    for pods in (int(p) for p in args.pods.split(",")):
        page_bytes, by_mode = measure_cost(
            pods, args.window, args.rounds, idle=not args.busy, settle=args.settle, modes=modes, baseline=args.baseline
        )
        medians = {
            mode: {key: statistics.median(run[key] for run in values) for key in values[0]}
            for mode, values in by_mode.items()
        }
        off = medians["scraping off"]["cores"] if "scraping off" in medians else 0.0
        for mode, m in medians.items():
            cost = m["cores"] - off
            per_scrape = f"{cost / m['scrapes_per_s'] * 1e6:9.0f}" if m["scrapes_per_s"] >= 1 else f"{'-':>9}"
            rounds = " ".join(f"{run['cores']:.3f}" for run in by_mode[mode])
            print(
                f"{pods:>5} {mode:<14} | {m['cores']:6.3f} {m['main_cores']:6.3f} {cost:6.3f} | "
                f"{m['scrapes_per_s']:9.0f} | {per_scrape} | {m['pod_ms_per_s']:8.3f} | {rounds}",
                flush=True,
            )
        print(f"{'':>5} ({page_bytes / 1024:.1f} KB whole page; {pods * 20} scrapes/s at 50 ms)")
    if args.skip_latency:
        return 0

    pods = max(int(p) for p in args.pods.split(","))
    print(
        f"\nRequest path through Envoy at ~{args.rate} req/s offered, {pods} pods, {args.rounds} alternating rounds "
        f"x {args.duration}s{', pinned (request process alone on CPU 0)' if args.pin else ', no pinning'}\n"
    )
    if args.pin:
        _WRK_PREFIX.extend(["taskset", "-c", "1"])
    results = measure_latency(pods, args.rate, args.connections, args.duration, args.rounds, pin=args.pin)
    summary = {}
    for mode, runs in results.items():
        summary[mode] = {key: statistics.median(run[key] for run in runs) for key in ("rps", "p50_ms", "p99_ms")}
        per_run = ", ".join(f"{run['p99_ms']:.2f}" for run in runs)
        print(
            f"  {mode:<13} req/s {summary[mode]['rps']:6.0f}   P50 {summary[mode]['p50_ms']:6.2f} ms   "
            f"P99 {summary[mode]['p99_ms']:6.2f} ms   "
            f"(P99 per round: {per_run}; errors {sum(r['errors'] for r in runs)})"
        )
    delta = summary["scraping on"]["p99_ms"] - summary["scraping off"]["p99_ms"]
    print(f"\n  P99 added by scraping: {delta:+.2f} ms (median of rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
