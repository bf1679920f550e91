"""What model-server telemetry costs: scrape CPU at 25/50/100 pods, and its effect on request latency.

Part 1, cost. A farm of stand-in pods (``epp.testing.farm``: full-size ~52 KB vLLM /metrics pages
rendered by the simulator, served from pre-built bytes in a separate process so serving them costs
the measurement nothing) and the picker scraping every pod every 50 ms (the upstream default). For
25, 50 and 100 pods: the picker's CPU over a fixed window (user + system from /proc, all threads)
divided by the window = cores used, next to the same picker with scraping off, and the scrape rate
actually achieved (from the picker's own ``epp_endpoint_scrapes_total``).

Part 2, request path. Envoy + picker in front of the 100-pod farm, wrk offering ~500 req/s (a Lua
delay per connection), the picker with scraping on and then off, alternating rounds; P50/P99 and
the achieved rate per run, medians per mode, and the P99 difference.

Run: ``python bench/scrape_cost.py`` (needs wrk). Talks only to 127.0.0.1; bounded in time.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from extproc_overhead import run_wrk  # noqa: E402

from epp.envoy_bootstrap import BootstrapOptions, render  # noqa: E402
from epp.testing.envoy import EnvoyProcess  # noqa: E402
from epp.testing.harness import PickerProcess, cpu_seconds, wait_for_picker  # noqa: E402

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


def start_farm(pods: int) -> tuple[subprocess.Popen[str], list[str], int]:
    process = subprocess.Popen([sys.executable, "-m", "epp.testing.farm", "--pods", str(pods)], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    page_bytes = int(process.stdout.readline().split()[1])
    hostports = [process.stdout.readline().split()[1] for _ in range(pods)]
    return process, hostports, page_bytes


def scrapes_done(picker: PickerProcess) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{picker.metrics_port}/metrics", timeout=5).read().decode()
    match = re.search(r"^epp_endpoint_scrapes_total (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def measure_cost(pods: int, window: float) -> dict[str, float]:
    farm, hostports, page_bytes = start_farm(pods)
    try:
        result: dict[str, float] = {"pods": pods, "page_bytes": page_bytes}
        for scraping in (True, False):
            picker = PickerProcess(hostports, extra_args=[f"--scrape-metrics={'true' if scraping else 'false'}"])
            picker.start()
            try:
                time.sleep(1.5)  # connections open, first pages parsed
                cpu0, scrapes0, t0 = cpu_seconds(picker.pid), scrapes_done(picker), time.monotonic()
                time.sleep(window)
                cpu1, scrapes1, t1 = cpu_seconds(picker.pid), scrapes_done(picker), time.monotonic()
            finally:
                picker.stop()
            key = "on" if scraping else "off"
            result[f"cores_{key}"] = (cpu1 - cpu0) / (t1 - t0)
            result[f"scrapes_per_s_{key}"] = (scrapes1 - scrapes0) / (t1 - t0)
        return result
    finally:
        farm.terminate()
        farm.wait(10)


def measure_latency(pods: int, rate: int, connections: int, duration: int, rounds: int) -> dict[str, list[dict[str, float]]]:
    farm, hostports, _ = start_farm(pods)
    work = Path(tempfile.mkdtemp(prefix="epp-scrape-bench-"))
    script = work / "rate.lua"
    script.write_text(_RATE_SCRIPT)
    results: dict[str, list[dict[str, float]]] = {"scraping on": [], "scraping off": []}
    try:
        for _ in range(rounds):
            for mode in results:
                picker = PickerProcess(hostports, extra_args=[f"--scrape-metrics={'true' if mode == 'scraping on' else 'false'}"])
                picker.start()
                envoy = EnvoyProcess(
                    render(BootstrapOptions(listen_address="127.0.0.1", listen_port=0, admin_port=0, picker_port=picker.grpc_port)),
                    concurrency=1,
                )
                try:
                    envoy.start()
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
        farm.terminate()
        farm.wait(10)


def _run_rate(url: str, script: Path, connections: int, duration: int, delay_ms: float) -> dict[str, float]:
    output = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{duration}s", "--latency", "-s", str(script), url],
        env={"EPP_BENCH_DELAY_MS": f"{delay_ms:.2f}", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
        timeout=duration + 60,
    ).stdout
    units = {"us": 1e-3, "ms": 1.0, "s": 1e3}

    def ms(text: str) -> float:
        number, unit = re.fullmatch(r"([\d.]+)([a-z]+)", text).groups()  # type: ignore[union-attr]
        return float(number) * units[unit]

    percentiles = dict(re.findall(r"^\s+(50|99)%\s+(\S+)$", output, re.M))
    errors = sum(int(n) for n in re.findall(r"Non-2xx or 3xx responses: (\d+)", output))
    return {
        "rps": float(re.search(r"Requests/sec:\s+([\d.]+)", output).group(1)),  # type: ignore[union-attr]
        "p50_ms": ms(percentiles["50"]),
        "p99_ms": ms(percentiles["99"]),
        "errors": errors,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", default="25,50,100", help="pool sizes for the cost part")
    parser.add_argument("--window", type=float, default=10.0, help="seconds of CPU measurement per pool size and mode")
    parser.add_argument("--rate", type=int, default=500, help="offered req/s for the latency part")
    parser.add_argument("--connections", type=int, default=10)
    parser.add_argument("--duration", type=int, default=10, help="seconds per latency run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-latency", action="store_true")
    args = parser.parse_args(argv)
    if not args.skip_latency and shutil.which("wrk") is None:
        print("wrk is needed: apt-get install wrk", file=sys.stderr)
        return 2

    print("Scrape cost: picker CPU (cores) with every pod scraped every 50 ms, vs the same picker with scraping off\n")
    print(f"{'pods':>5} | {'page':>7} | {'cores, scraping':>15} {'cores, off':>10} {'scraping alone':>14} | {'scrapes/s':>9} {'target/s':>8}")
    for pods in (int(p) for p in args.pods.split(",")):
        r = measure_cost(pods, args.window)
        print(
            f"{pods:>5} | {r['page_bytes'] / 1024:5.1f}KB | {r['cores_on']:15.3f} {r['cores_off']:10.3f} "
            f"{r['cores_on'] - r['cores_off']:14.3f} | {r['scrapes_per_s_on']:9.0f} {pods * 20:8d}",
            flush=True,
        )
    if args.skip_latency:
        return 0

    pods = max(int(p) for p in args.pods.split(","))
    print(f"\nRequest path through Envoy at ~{args.rate} req/s offered, {pods} pods, {args.rounds} alternating rounds x {args.duration}s\n")
    results = measure_latency(pods, args.rate, args.connections, args.duration, args.rounds)
    summary = {}
    for mode, runs in results.items():
        summary[mode] = {key: statistics.median(run[key] for run in runs) for key in ("rps", "p50_ms", "p99_ms")}
        per_run = ", ".join(f"{run['p99_ms']:.2f}" for run in runs)
        print(
            f"  {mode:<13} req/s {summary[mode]['rps']:6.0f}   P50 {summary[mode]['p50_ms']:6.2f} ms   "
            f"P99 {summary[mode]['p99_ms']:6.2f} ms   (P99 per round: {per_run}; errors {sum(r['errors'] for r in runs)})"
        )
    delta = summary["scraping on"]["p99_ms"] - summary["scraping off"]["p99_ms"]
    print(f"\n  P99 added by scraping: {delta:+.2f} ms (median of rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
