"""bench/routing_quality.py: its oracle against the simulator, its traces, and a smoke run of the machinery.

The smoke run is tiny (2 pods, half a second of arrivals per run, three runs) and checks structure and
invariants only: the numbers themselves are the benchmark's business, not the test suite's.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from epp.sim import Engine, EngineConfig
from epp.sim.request import Sink
from epp.sim.tokens import render_chat
from epp.testing.peers import unavailable

_PATH = Path(__file__).resolve().parents[2] / "bench" / "routing_quality.py"


def _load_bench():
    spec = importlib.util.spec_from_file_location("routing_quality", _PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


rq = _load_bench()

_TINY = dict(
    pods=2, groups=4, duration=0.5, drain=20.0, time_scale=0.25, max_tokens=4, num_gpu_blocks=1024, idle_window=0.2
)


def _turn(*messages: tuple[str, str], max_tokens: int = 4, seed: int = 1):
    return rq._turn(tuple(messages), max_tokens, seed)


def _workload(*items) -> object:
    return rq.Workload("t", tuple(items), 1.0, 1.0)


def test_oracle_counts_whole_blocks_of_a_repeated_prompt_but_not_its_last_token() -> None:
    turn = _turn(("user", "abcd" * 100))
    prompt = turn.prompt_tokens
    rate = rq.oracle_hit_rate(_workload(rq.Item(None, (turn,), ()), rq.Item(None, (turn,), ())), seed=1)
    assert rate == ((prompt - 1) // 16 * 16) / (2 * prompt)
    assert rq.oracle_hit_rate(_workload(rq.Item(None, (turn,), ())), seed=1) == 0.0


async def _sequential_engine_hit_rate(workload, seed: int, blocks: int = 1 << 16) -> float:
    # One pod, requests one at a time in trace order: the oracle's own assumptions (with 2**16 blocks its
    # cache never evicts).
    engine = Engine(EngineConfig(time_scale=0.0001, seed=seed, num_gpu_blocks=blocks, max_model_len=blocks * 16))
    engine.start()
    try:
        for item in workload.items:
            for turn in item.turns:
                sink = Sink()
                req = engine.new_request(
                    rq.MODEL, render_chat(turn.messages), max_tokens=len(turn.answer) // 4, ignore_eos=True, sink=sink
                )
                engine.submit(req)
                while not req.finished:
                    await sink.wait()
                assert req.text() == turn.answer  # the trace knows the simulator's answers in advance
    finally:
        await engine.stop()
    return engine.stats.prefix_cache_hits / engine.stats.prefix_cache_queries


@pytest.mark.parametrize("kind", ["a", "b"])
async def test_oracle_equals_the_simulator_with_an_unbounded_cache_and_no_concurrency(kind: str) -> None:
    opts = rq.Options(**{**_TINY, "duration": 0.3})
    workload = rq.make_workload(kind, opts)
    assert workload.requests >= 3
    oracle = rq.oracle_hit_rate(workload, seed=opts.seed)
    assert oracle > 0.3
    assert oracle == pytest.approx(await _sequential_engine_hit_rate(workload, opts.seed), abs=1e-12)


async def test_the_finite_bound_with_lru_is_the_simulator_with_that_cache_and_min_does_no_worse() -> None:
    opts = rq.Options(**{**_TINY, "duration": 1.0})
    workload = rq.make_workload("a", opts)
    longest = max(t.prompt_tokens + len(t.answer) // 4 for item in workload.items for t in item.turns) // 16 + 2
    unlimited = rq.oracle_hit_rate(workload, seed=opts.seed)
    assert rq.finite_hit_rate(workload, 1 << 16, seed=opts.seed) == unlimited
    for blocks in (longest, 2 * longest):  # caches that evict
        lru = rq.finite_hit_rate(workload, blocks, seed=opts.seed)
        assert lru < unlimited - 0.2
        # vLLM's order (a request's hits held while it runs, its blocks freed tail first), not exactly its
        # bookkeeping (a block computed again beside a cached copy is one block here).
        assert lru == pytest.approx(await _sequential_engine_hit_rate(workload, opts.seed, blocks), abs=0.005)
        assert lru <= rq.finite_hit_rate(workload, blocks, seed=opts.seed, policy="min") <= unlimited


def test_routers_over_pods_reach_the_oracle_with_room_enough_and_fall_short_of_it_under_pressure() -> None:
    opts = rq.Options(**{**_TINY, "duration": 1.0})
    workload = rq.make_workload("a", opts)
    unlimited = rq.oracle_hit_rate(workload, seed=opts.seed)
    longest = max(t.prompt_tokens + len(t.answer) // 4 for item in workload.items for t in item.turns) // 16 + 2
    for routed in (rq.knowing_router_hit_rate, rq.placed_hit_rate):
        # Each family kept on one pod: with room for everything, every repeat hits as in one shared cache.
        assert routed(workload, 2, 1 << 16, seed=opts.seed) == pytest.approx(unlimited, abs=1e-12)
        assert routed(workload, 2, longest, seed=opts.seed) < unlimited - 0.1
    # A pod per family, each with room for one family's requests: kept apart, the families hit as in the oracle.
    families = {item.family for item in workload.items}
    assert len(families) == opts.groups
    squeezed = rq.placed_hit_rate(workload, opts.groups, longest, seed=opts.seed)
    assert squeezed == pytest.approx(unlimited, abs=0.02)


def test_traces_are_deterministic_and_sized_by_the_load() -> None:
    opts = rq.Options(**_TINY)
    first, again = rq.make_workload("a", opts), rq.make_workload("a", opts)
    assert first == again
    double = rq.make_workload("a", rq.Options(**{**_TINY, "load": 1.4}))
    assert double.rate_per_s == pytest.approx(2 * first.rate_per_s)
    assert abs(double.requests - 2 * first.requests) <= 1
    arrivals = [item.at_s for item in first.items]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    # a: every request is a group's system prompt plus a question; b: each turn extends the previous one.
    assert {item.turns[0].messages[0] for item in first.items} <= {
        ("system", p) for p in rq._group_prompts(np.random.default_rng([opts.seed, 0]), opts.groups)
    }
    for item in rq.make_workload("b", opts).items:
        for before, after in zip(item.turns, item.turns[1:], strict=False):
            assert after.messages[: len(before.messages)] == before.messages
            assert after.messages[len(before.messages)] == ("assistant", before.answer)
    assert len({item.turns[0].messages[0] for item in rq.make_workload("c", opts).items}) == len(
        rq.make_workload("c", opts).items
    )


@pytest.mark.parametrize(
    "change, message",
    [
        ({"workloads": ("x",)}, "unknown workload"),
        ({"policies": ("random",)}, "unknown policy"),
        ({"load": 0}, "load must be positive"),
        ({"pods": 0}, "pods must be at least 1"),
        ({"popularity": "pareto"}, "popularity"),
    ],
)
def test_bad_options_are_refused_with_a_message(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        rq.Options(**{**_TINY, **change})


def test_a_picker_policy_names_extra_picker_flags() -> None:
    assert rq._picker_flags("default+io-thread=false") == ("default", ["--io-thread=false"])
    assert not rq._observes("default+io-thread=false")
    # +observe is Envoy's: the picker behind an Envoy that observes responses, no picker flag.
    assert rq._picker_flags("default+observe+io-thread=false") == ("default", ["--io-thread=false"])
    assert rq._observes("default+observe+io-thread=false") and rq._observes("default+observe@/tmp/py")
    rq.Options(**{**_TINY, "policies": ("default+observe",)})  # accepted
    rq.Options(**{**_TINY, "policies": ("default+io-thread=false",)})  # accepted
    with pytest.raises(ValueError, match="unknown policy 'random'"):
        rq.Options(**{**_TINY, "policies": ("random+io-thread=false",)})
    # Envoy alone and the no-work server run no picker: a picker's flag or interpreter is refused, not
    # read as a config file named after them.
    for policy in ("floor+observe", "rr+io-thread=false", "floor@/tmp/py"):
        with pytest.raises(ValueError, match="runs no picker"):
            rq.Options(**{**_TINY, "policies": (policy,)})
    assert rq.Options(**{**_TINY, "policies": ("rr", "floor")}).policies == ("rr", "floor")


def test_main_refuses_an_unknown_workload_without_starting_anything(capsys: pytest.CaptureFixture[str]) -> None:
    assert rq.main(["--workloads", "a,z"]) == 2
    assert "unknown workload 'z'" in capsys.readouterr().err


def test_smoke_run_through_envoy_the_picker_and_the_simulator() -> None:
    opts = rq.Options(**_TINY)
    blocks = rq.num_gpu_blocks(opts)
    results = []
    # Every policy once, both client shapes (single requests, sessions), in three runs of a second or so.
    workload = rq.make_workload("a", opts)
    oracle = rq.oracle_hit_rate(workload, seed=opts.seed)
    for policy in ("rr", "default"):
        results.append(rq.run_policy(workload, policy, opts, oracle, blocks))
    chat = rq.make_workload("b", opts)
    results.append(rq.run_policy(chat, "queue-kv", opts, rq.oracle_hit_rate(chat, seed=opts.seed), blocks))
    assert [(r.workload, r.policy) for r in results] == [("a", "rr"), ("a", "default"), ("b", "queue-kv")]

    for r in results:
        assert r.completed == r.requests > 0 and r.errors == r.unfinished == 0, r
        assert r.wrong_answers == 0  # what the trace predicted is what came back through Envoy
        assert 0.0 <= r.hit_rate <= r.oracle_hit_rate + 1e-9, r
        assert 0 < r.ttft_p50_ms <= r.ttft_p90_ms
        assert r.req_per_s > 0 and r.tokens_per_s == pytest.approx(r.req_per_s * opts.max_tokens)
        picker = {"picker", rq._PICKER_MAIN} if r.policy != "rr" else set()
        expected = {"simulator", "envoy", "client"} | picker
        assert set(r.cpu_cores) == set(r.cpu_s) == expected
        # Routing CPU: Envoy, and the picker's with its idle rate (measured before the load) apart.
        assert set(rq.routing_cpu_per_1k(r)) == expected - {"simulator", "client", rq._PICKER_MAIN}
        if picker:  # its request path is a part of it, the rest its scrape worker
            path, worker = rq._picker_parts(r)
            assert path > 0 and worker >= 0
            assert path + worker == pytest.approx(r.cpu_s["picker"] / r.completed * 1000)
        assert set(r.idle_cores) == ({"picker", "envoy"} if r.policy != "rr" else set())
    # Prefix affinity: a group's requests after the first mostly stay on one pod. Not always: the
    # default profile also weighs queues, and on a loaded machine a pod's scraped queue can outweigh
    # a prefix (seen: 6 of 7 stayed, under a load average of 13 on 2 cores).
    default = next(r for r in results if r.workload == "a" and r.policy == "default")
    assert default.stickiness is not None and default.stickiness >= 0.75 and default.hit_rate > 0

    table = rq.format_table(results).splitlines()
    assert table[0].split()[:4] == ["workload", "policy", "hit", "rate"]
    rows = [line for line in table[2:] if re.search(r"\d+/\d+", line)]
    assert len(rows) == len(results)
    assert sum("oracle (bound)" in line for line in table) == 2
    assert re.search(r"^a shared prefix\s+round robin\s+[\d.]+%\s+\d+%\s+\d+ms\s+\d+ms\s+1\.00\s", table[2])


def test_the_floor_policy_routes_through_a_no_work_ext_proc_server_and_is_counted_as_the_picker() -> None:
    # bench/passthrough_picker.py behind the same Envoy configuration: what the protocol's messages cost.
    opts = rq.Options(**_TINY)
    workload = rq.make_workload("a", opts)
    r = rq.run_policy(workload, "floor", opts, rq.oracle_hit_rate(workload, seed=opts.seed), rq.num_gpu_blocks(opts))
    assert r.completed == r.requests > 0 and r.errors == r.unfinished == 0 and r.wrong_answers == 0, r
    assert set(r.cpu_s) == {"simulator", "envoy", "client", "picker", rq._PICKER_MAIN}
    assert set(rq.routing_cpu_per_1k(r)) == {"picker", "envoy"} and set(r.idle_cores) == {"picker", "envoy"}
    # Its CPU is its one process's: no scrape worker. (Not asserted above zero: /proc counts CPU in 10 ms
    # ticks, and a no-work server may use less than one over a run this small.)
    assert r.cpu_s["picker"] == r.cpu_s[rq._PICKER_MAIN] >= 0 and rq._picker_parts(r)[1] == 0
    # Round robin over both pods, whatever the prefix: each pod serves half (one more at most).
    assert r.imbalance <= (r.requests // 2 + 1) / (r.requests / 2)


def _result(workload: str, policy: str, hit_rate: float) -> object:
    return rq.Result(workload, policy, 10, 10, 0, 0, hit_rate, 0.9, 20.0, 40.0, 5.0, 80.0, {"client": 0.1})


def test_chart_is_a_png_with_every_workload_and_policy(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "chart.png"
    results = [_result(w, p, 0.5) for w in ("a", "c") for p in ("rr", "default")]
    assert rq.write_chart(results, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_matplotlib_the_chart_is_skipped_and_nothing_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes ``import matplotlib`` raise ImportError
    assert rq.write_chart([_result("a", "rr", 0.5)], tmp_path / "chart.png") is False
    assert not (tmp_path / "chart.png").exists()


@pytest.mark.parametrize("kind", ["sglang-router", "vllm-router"])
def test_smoke_run_through_a_peer_router_on_the_same_trace(kind: str) -> None:
    if (why := unavailable(kind)) is not None:
        pytest.skip(f"{why}: the peer comparison cannot run here")
    opts = rq.Options(**_TINY)
    workload = rq.make_workload("a", opts)
    r = rq.run_policy(workload, kind, opts, rq.oracle_hit_rate(workload, seed=opts.seed), rq.num_gpu_blocks(opts))
    assert (r.workload, r.policy) == ("a", kind)
    assert r.completed == r.requests > 0 and r.errors == r.unfinished == 0, r
    assert r.wrong_answers == 0  # what the trace predicted came back through the router
    assert 0.0 < r.hit_rate <= r.oracle_hit_rate + 1e-9  # cache_aware: a group's prompt stays on its pod
    # The client talked to the router alone (no Envoy, no picker); its CPU is the routing CPU, whole.
    assert set(r.cpu_cores) == set(r.cpu_s) == {"simulator", kind, "client"}
    assert set(rq.routing_cpu_per_1k(r)) == {kind} and r.idle_cores == {}
    if kind == "vllm-router":
        # Its cache_aware got token ids from every pod's render endpoint for every request.
        assert r.router_stats["input:render"] == r.requests * opts.pods
        assert r.router_stats.get("decision:missing_tokens", 0) == 0
        assert rq._router_warning(r) is None
    assert rq._router_warning(dataclasses.replace(r, policy="vllm-router", router_stats={})) is not None


def _cpu_result(
    policy: str, round_: int, cpu_s: dict[str, float], idle: dict[str, float] | None = None, p90: float = 40.0
) -> object:
    return rq.Result(
        "a",
        policy,
        100,
        100,
        0,
        0,
        0.5,
        0.9,
        20.0,
        p90,
        5.0,
        80.0,
        {"client": 0.1},
        wall_s=10.0,
        round=round_,
        cpu_s=cpu_s,
        idle_cores=idle or {},
    )


def test_routing_cpu_is_per_thousand_completed_requests_and_the_picker_is_counted_above_its_idle_rate() -> None:
    r = _cpu_result(
        "default", 0, {"picker": 0.9, "envoy": 0.3, "simulator": 5.0, "client": 1.0}, {"picker": 0.04, "envoy": 0.001}
    )
    per = rq.routing_cpu_per_1k(r)
    assert per == pytest.approx({"picker": (0.9 - 0.04 * 10.0) / 100 * 1000, "envoy": 3.0})  # pods, client: not routing
    assert rq.routing_cpu_per_1k(_cpu_result("sglang-router", 0, {"sglang-router": 0.2, "simulator": 1})) == {
        "sglang-router": pytest.approx(2.0)
    }
    assert rq.routing_cpu_per_1k(dataclasses.replace(r, completed=0)) == {}


def test_rounds_are_summarised_by_medians_and_the_cpu_table_checks_the_target() -> None:
    runs = [
        _cpu_result("default", i, {"picker": p, "envoy": 0.3}, {"picker": 0.01}, p90=p90)
        for i, (p, p90) in enumerate([(0.5, 40.0), (0.7, 60.0), (0.6, 50.0)])
    ]
    runs += [_cpu_result("sglang-router", i, {"sglang-router": c}) for i, c in enumerate([0.2, 0.3, 0.1])]
    medians = rq.median_results(runs)
    assert [(m.policy, m.round) for m in medians] == [("default", -1), ("sglang-router", -1)]
    assert medians[0].ttft_p90_ms == 50.0 and medians[0].requests == 300 and medians[0].cpu_s["picker"] == 0.6
    assert rq.median_results(runs[:1]) == runs[:1]
    table = rq.format_cpu_table(runs, pods=8)
    # picker above idle: (0.6 - 0.01 x 10) / 100 x 1000 = 5.0 per 1k; sglang-router 2.0: ratio 2.5, target 0.5.
    assert re.search(r"prefix \+ queue \+ KV\s+8\.00\s+\[7\.00 9\.00 8\.00\]\s+5\.00\s+3\.00\s+-\s+0\.010 cores", table)
    assert re.search(r"sglang-router\s+2\.00\s+\[2\.00 3\.00 1\.00\]\s+-\s+-\s+2\.00", table)
    assert "picker idle 0.010 cores at 8 pods" in table
    assert "prefix + queue + KV 5.00 / 2.00 = 2.50 (not met: 5.0x the target)" in table
    # The no-work server's ratio is printed beside, as the protocol's floor, not as a picker meeting the target.
    floor = [_cpu_result("floor", i, {"picker": 0.15, "envoy": 0.3}, {"picker": 0.0}) for i in range(3)]
    table = rq.format_cpu_table(runs + floor, pods=8)
    assert "the protocol's floor (the same ext_proc messages, no work) / sglang-router: 1.50 / 2.00 = 0.75" in table
    assert not [line for line in table.splitlines() if "target (issue 14)" in line and "no-work" in line]


@pytest.mark.parametrize(
    "policy, message",
    [("sglang-router:kv_aware", "sglang-router policies are"), ("haproxy", "unknown policy 'haproxy'")],
)
def test_peer_policies_are_checked_like_the_others(policy: str, message: str) -> None:
    assert rq.Options(**{**_TINY, "policies": ("vllm-router:round_robin",)}).policies == ("vllm-router:round_robin",)
    assert rq._label("vllm-router:round_robin") == "vllm-router round_robin"
    assert rq._label("vllm-router") == "vllm-router"
    with pytest.raises(ValueError, match=message):
        rq.Options(**{**_TINY, "policies": (policy,)})


def test_the_cpu_comparison_preset_sets_issue_14s_run_and_explicit_flags_win() -> None:
    args = rq._parser(preset=True).parse_args(["--cpu-comparison", "--rounds", "1"])
    assert args.policies == "rr,default,floor,sglang-router,vllm-router"
    assert (args.rounds, args.max_tokens, args.duration) == (1, 16, 20.0)
    assert rq._parser().parse_args([]).rounds == 1
