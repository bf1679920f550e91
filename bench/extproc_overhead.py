"""What the picker costs on the request path, measured side by side through a real Envoy.

Two Envoys run at once in front of the same echo backends (one worker thread each):

* ``direct``: Envoy alone, round robin to the backends (no ext_proc);
* ``epp``:    Envoy with the reference ext_proc configuration (header modes SEND, body modes
  FULL_DUPLEX_STREAMED both ways, trailers SEND) calling the picker, which parses each body,
  picks an endpoint and streams the request and response bodies back;
* ``base``:   the same with another tree's picker (``--baseline-python``: that tree's virtualenv's
  python), to compare two versions side by side in one run;
* ``observe`` (``--observe``): this tree's picker behind an Envoy that observes responses
  (``epp envoy-config --observe-responses``: no picker round trip on the response's path);
* ``tls``, ``tls-uv`` (``--tls``): this tree's picker serving TLS (``--secure-serving=true``,
  upstream's default) to an Envoy that uses it, its records in C and (``tls-uv``) the event loop's
  (``--native-tls=false``).

For each prompt size, wrk drives both at the same fixed concurrency, alternating direct/epp for
several rounds so that machine noise lands on both alike; the table shows medians over rounds:
req/s, P50/P99 latency, their epp/direct ratios, and the picker's CPU milliseconds per request
(user + system time of the picker process from /proc, divided by the requests wrk completed).

Run: ``python bench/extproc_overhead.py`` (needs ``wrk``: ``apt-get install wrk``). It talks only
to 127.0.0.1 and stops by itself (about 2 sizes x 2 modes x rounds x duration seconds).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from epp.envoy.bootstrap import BootstrapOptions, render, render_round_robin
from epp.testing.envoy import EnvoyProcess, free_port
from epp.testing.harness import PickerProcess, cpu_seconds, wait_for_picker

_WRK_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local f = assert(io.open(os.getenv("EPP_BENCH_BODY"), "rb"))
wrk.body = f:read("*a")
f:close()
"""

_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}


@dataclass
class Run:
    mode: str
    prompt_bytes: int
    requests: int
    errors: int
    rps: float
    p50_ms: float
    p99_ms: float
    picker_cpu_ms_per_request: float | None


def _seconds(text: str) -> float:
    number, unit = re.fullmatch(r"([\d.]+)([a-z]+)", text).groups()  # type: ignore[union-attr]
    return float(number) * _UNITS[unit]


def run_wrk(url: str, body_file: Path, script: Path, *, connections: int, duration: float) -> dict[str, float]:
    output = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(duration))}s", "--latency", "-s", str(script), url],
        env={"EPP_BENCH_BODY": str(body_file), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
        timeout=duration + 60,
    ).stdout
    percentiles = dict(re.findall(r"^\s+(50|99)%\s+(\S+)$", output, re.M))
    requests = int(re.search(r"(\d+) requests in", output).group(1))  # type: ignore[union-attr]
    errors = sum(int(n) for n in re.findall(r"Non-2xx or 3xx responses: (\d+)", output))
    socket_errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", output)
    if socket_errors:
        errors += sum(int(n) for n in socket_errors.groups())
    return {
        "requests": requests,
        "errors": errors,
        "rps": float(re.search(r"Requests/sec:\s+([\d.]+)", output).group(1)),  # type: ignore[union-attr]
        "p50": _seconds(percentiles["50"]),
        "p99": _seconds(percentiles["99"]),
    }


def _prompt_body(size: int, directory: Path) -> Path:
    words = ("the quick brown fox jumps over the lazy dog " * (size // 44 + 1))[:size]
    path = directory / f"prompt-{size}.json"
    path.write_bytes(json.dumps({"model": "bench-model", "prompt": words, "max_tokens": 16}).encode())
    return path


def _start_backends(count: int) -> tuple[subprocess.Popen[str], list[str]]:
    process = subprocess.Popen(
        [sys.executable, "-m", "epp.testing.backends", "--count", str(count)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    hostports = [process.stdout.readline().split()[1] for _ in range(count)]
    return process, hostports


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1024,409600", help="prompt sizes in bytes, comma-separated")
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--duration", type=int, default=8, help="seconds per wrk run")
    parser.add_argument("--rounds", type=int, default=3, help="alternating direct/epp rounds per size")
    parser.add_argument("--json", type=Path, help="also write the runs here")
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also measure bench/passthrough_picker.py: the same ext_proc exchange on epp's transport, with no work (the floor)",
    )
    parser.add_argument("--baseline-python", help="another tree's python: its picker runs beside this one (mode base)")
    parser.add_argument("--tls", action="store_true", help="also modes tls and tls-uv: the picker serving TLS")
    parser.add_argument(
        "--observe",
        action="store_true",
        help="also mode observe: a picker behind an Envoy that observes responses (--observe-responses)",
    )
    args = parser.parse_args(argv)
    if shutil.which("wrk") is None:
        print("wrk is needed: apt-get install wrk", file=sys.stderr)
        return 2

    work = Path(tempfile.mkdtemp(prefix="epp-bench-"))
    script = work / "post.lua"
    script.write_text(_WRK_SCRIPT)
    backends, pool = _start_backends(2)
    picker = PickerProcess(pool)
    baseline = PickerProcess(pool, python=args.baseline_python) if args.baseline_python else None
    floor: subprocess.Popen[bytes] | None = None
    more_pickers: dict[str, PickerProcess] = {}  # mode -> this tree's picker in another setting (--tls, --observe)
    if args.tls:
        more_pickers["tls"] = PickerProcess(pool, tls=True)
        more_pickers["tls-uv"] = PickerProcess(pool, tls=True, extra_args=["--native-tls=false"])
    if args.observe:
        more_pickers["observe"] = PickerProcess(pool)
    envoys: list[EnvoyProcess] = []
    runs: list[Run] = []
    try:
        picker.start()
        if baseline is not None:
            baseline.start()
        for other in more_pickers.values():
            other.start()
        base = BootstrapOptions(listen_address="127.0.0.1", listen_port=0, admin_port=0, pool_endpoints=tuple(pool))
        direct = EnvoyProcess(render_round_robin(base), concurrency=1)
        via_epp = EnvoyProcess(render(replace(base, picker_port=picker.grpc_port)), concurrency=1)
        # mode -> (Envoy, pid of the ext_proc process whose CPU is counted)
        targets: dict[str, tuple[EnvoyProcess, int | None]] = {"direct": (direct, None), "epp": (via_epp, picker.pid)}
        if baseline is not None:
            via_base = EnvoyProcess(render(replace(base, picker_port=baseline.grpc_port)), concurrency=1)
            targets["base"] = (via_base, baseline.pid)
        for mode, other in more_pickers.items():
            observe = mode == "observe"
            options = replace(base, picker_port=other.grpc_port, picker_tls=not observe, observe_responses=observe)
            targets[mode] = (EnvoyProcess(render(options), concurrency=1), other.pid)
        if args.floor:
            floor_port = free_port()
            floor = subprocess.Popen(
                [sys.executable, str(Path(__file__).with_name("passthrough_picker.py")), "--port", str(floor_port), "--endpoints", ",".join(pool)]
            )
            targets["floor"] = (EnvoyProcess(render(replace(base, picker_port=floor_port)), concurrency=1), floor.pid)
        envoys += [envoy for envoy, _ in targets.values()]
        for envoy in envoys:
            envoy.start()
        for envoy, pid in targets.values():
            if pid is not None:
                wait_for_picker(envoy)
        for size in (int(s) for s in args.sizes.split(",")):
            body = _prompt_body(size, work)
            for envoy, _ in targets.values():  # warm-up: connections, caches
                run_wrk(f"http://127.0.0.1:{envoy.listen_port}/v1/completions", body, script, connections=args.connections, duration=1)
            for _ in range(args.rounds):
                for mode, (envoy, pid) in targets.items():
                    before = cpu_seconds(pid) if pid else 0.0
                    result = run_wrk(
                        f"http://127.0.0.1:{envoy.listen_port}/v1/completions",
                        body,
                        script,
                        connections=args.connections,
                        duration=args.duration,
                    )
                    used = cpu_seconds(pid) - before if pid else 0.0
                    runs.append(
                        Run(
                            mode=mode,
                            prompt_bytes=size,
                            requests=int(result["requests"]),
                            errors=int(result["errors"]),
                            rps=result["rps"],
                            p50_ms=result["p50"] * 1e3,
                            p99_ms=result["p99"] * 1e3,
                            picker_cpu_ms_per_request=used * 1e3 / result["requests"] if pid else None,
                        )
                    )
                    time.sleep(0.5)
    finally:
        for envoy in envoys:
            envoy.stop()
        picker.stop()
        if baseline is not None:
            baseline.stop()
        for other in more_pickers.values():
            other.stop()
        if floor is not None:
            floor.terminate()
            floor.wait(10)
        backends.terminate()
        backends.wait(10)

    _print_table(runs, args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([asdict(r) for r in runs], indent=2))
    return 1 if any(r.errors for r in runs) else 0


def _print_table(runs: list[Run], args: argparse.Namespace) -> None:
    print(
        f"\nEnvoy -> backend (direct) vs Envoy -> picker -> backend, {args.connections} connections, "
        f"{args.rounds} rounds x {args.duration:.0f}s each, medians\n"
    )
    header = (
        f"{'prompt':>8} {'picker':>6} | {'direct req/s':>12} {'req/s':>8} {'ratio':>6} | "
        f"{'P50 direct':>10} {'P50':>8} {'added':>8} | {'P99 direct':>10} {'P99':>8} {'ratio':>6} | "
        f"{'CPU ms/req':>10} | errors"
    )
    print(header)
    print("-" * len(header))

    def med(rows: list[Run], field: str) -> float:
        return statistics.median(getattr(r, field) for r in rows)

    for size in sorted({r.prompt_bytes for r in runs}):
        direct = [r for r in runs if r.prompt_bytes == size and r.mode == "direct"]
        rps_d, p50_d, p99_d = med(direct, "rps"), med(direct, "p50_ms"), med(direct, "p99_ms")
        for mode in ("epp", "base", "tls", "tls-uv", "observe", "floor"):
            rows = [r for r in runs if r.prompt_bytes == size and r.mode == mode]
            if not rows:
                continue
            rps, p50, p99 = med(rows, "rps"), med(rows, "p50_ms"), med(rows, "p99_ms")
            cpu = med(rows, "picker_cpu_ms_per_request")
            label = f"{size / 1024:.0f} KB"
            print(
                f"{label:>8} {mode:>6} | {rps_d:12.0f} {rps:8.0f} {rps / rps_d:6.2f} | "
                f"{p50_d:8.2f}ms {p50:6.2f}ms {p50 - p50_d:6.2f}ms | {p99_d:8.2f}ms {p99:6.2f}ms {p99 / p99_d:6.2f} | "
                f"{cpu:10.3f} | {sum(r.errors for r in direct + rows)}"
            )
            print(f"{'':>15}   CPU ms/req per round: {', '.join(f'{r.picker_cpu_ms_per_request:.3f}' for r in rows)}")


if __name__ == "__main__":
    sys.exit(main())
