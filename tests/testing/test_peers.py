"""epp.testing.peers: the peer routers start on loopback only, route to the pods, and stop by PID.

The routers are real (the PyPI packages of the ``test`` extra); a test of a router that is not
installed here skips, naming the package to install.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from epp.testing import peers
from epp.testing.peers import PeerError, PeerRouter, render_counts, unavailable

_PODS = 2


@pytest.fixture(scope="module")
def pods() -> Iterator[list[str]]:
    """Two simulated pods with the render endpoints on (vllm-router's cache_aware asks them)."""
    sim = subprocess.Popen(
        [sys.executable, "-m", "epp.sim", "--pods", str(_PODS), "--enable-scale-out", "--time-scale", "0.05"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    assert sim.stdout is not None
    try:
        yield [sim.stdout.readline().split()[1] for _ in range(_PODS)]
    finally:
        sim.terminate()
        sim.wait(10)


def _listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket ``pid`` listens on, from /proc (IPv4 and IPv6)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd) if fd.is_symlink() else ""
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # 0A: LISTEN
                address, port = local.split(":")
                if table == "tcp":
                    address = ".".join(str(b) for b in reversed(bytes.fromhex(address)))
                found.add((address, int(port, 16)))
    return found


def _chat(url: str, text: str) -> tuple[int, str]:
    body = {"model": "meta-llama/Llama-3.1-8B-Instruct", "messages": [{"role": "user", "content": text}],
            "max_tokens": 2, "ignore_eos": True}
    request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.status, response.headers["x-sim-pod"]


@pytest.mark.parametrize("kind", list(peers.KINDS))
def test_a_router_listens_on_loopback_only_routes_and_stops_by_pid(kind: str, pods: list[str]) -> None:
    if (why := unavailable(kind)) is not None:
        pytest.skip(why)
    with PeerRouter.start(kind, pods, policy="cache_aware") as router:
        # Every listener, Prometheus included, on 127.0.0.1 (their defaults are 0.0.0.0 for sglang-router).
        assert _listening(router.pid) == {("127.0.0.1", router.port), ("127.0.0.1", router.metrics_port)}
        prompt = "abcd " * 300
        served = [_chat(router.url, prompt) for _ in range(3)]
        assert all(status == 200 for status, _ in served)
        assert len({pod for _, pod in served}) == 1  # cache_aware keeps one prompt on one pod
        samples = router.metrics()
        assert samples
        if kind == "vllm-router":
            # Token ids from the pods' render endpoints, one per pod per request; never routed blind.
            counts = render_counts(samples)
            assert counts["input:render"] == 3 * len(pods)
            assert counts.get("decision:missing_tokens", 0) == 0
            assert counts.get("decision:prefix_hit", 0) == 2
        pid, log = router.pid, Path(router._log.name)
        assert log.exists()
    assert not router.running
    assert not Path(f"/proc/{pid}").exists()
    assert not log.exists()
    assert router.log_tail(400)  # its start-up lines survive the file
    router.stop()  # idempotent


def test_unknown_kinds_and_policies_are_refused_before_anything_starts() -> None:
    with pytest.raises(ValueError, match="unknown router kind 'nginx'"):
        PeerRouter.start("nginx", ["127.0.0.1:1"])
    with pytest.raises(ValueError, match="sglang-router has no policy 'kv_aware'"):
        PeerRouter.start("sglang-router", ["127.0.0.1:1"], policy="kv_aware")
    with pytest.raises(ValueError, match="at least one worker"):
        PeerRouter.start("vllm-router", [])


def test_a_router_that_is_not_installed_is_an_error_saying_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> str:
        raise peers.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(peers.metadata, "version", missing)
    assert peers.version("vllm-router") is None
    assert unavailable("vllm-router") == (
        "vllm-router is not installed: pip install vllm-router (or pip install -e '.[bench]')"
    )
    with pytest.raises(PeerError, match="pip install vllm-router"):
        PeerRouter.start("vllm-router", ["127.0.0.1:1"])


def test_a_router_that_cannot_reach_its_workers_is_not_ready_and_is_stopped() -> None:
    if (why := unavailable("vllm-router")) is not None:
        pytest.skip(why)
    # Port 1 on loopback refuses connections: the worker never becomes healthy.
    with pytest.raises(PeerError, match=r"vllm-router (was not ready in time|exited)") as caught:
        PeerRouter.start("vllm-router", ["127.0.0.1:1"], timeout=3.0)
    assert "0 of 1 workers healthy" in str(caught.value) or "exited" in str(caught.value)
    assert not peers._running  # nothing left behind


def test_render_counts_sum_each_result_and_outcome_over_the_other_labels() -> None:
    samples = {
        'vllm_router_kv_routing_inputs_total{transport="http",result="render"}': 16.0,
        'vllm_router_kv_routing_inputs_total{transport="grpc",result="render"}': 2.0,
        'vllm_router_kv_routing_inputs_total{transport="http",result="preparation_rejected"}': 4.0,
        'vllm_router_prefix_routing_decisions_total{policy="cache_aware",stage="regular",outcome="prefix_hit"}': 1.0,
        'vllm_router_prefix_routing_decisions_total{policy="cache_aware",stage="regular",outcome="missing_tokens"}':
            2.0,
        'vllm_router_policy_decisions_total{policy="cache_aware",worker="http://127.0.0.1:1"}': 3.0,
    }
    assert render_counts(samples) == {"input:render": 18.0, "input:preparation_rejected": 4.0,
                                      "decision:prefix_hit": 1.0, "decision:missing_tokens": 2.0}
