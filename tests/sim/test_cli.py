import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import epp.sim

REPO = Path(__file__).resolve().parents[2]


def test_public_api() -> None:
    assert epp.sim.__all__ == ["Engine", "EngineConfig", "KVCache", "SimRequest", "SimulatedPod", "SimulatedPool"]


def test_cli_serves_pods_until_sigterm() -> None:
    args = [sys.executable, "-m", "epp.sim", "--pods", "2", "--base-port", "0", "--seed", "1", "--time-scale", "0.1",
            "--max-num-seqs", "4", "--lora-adapters", "a,b", "--max-loras", "2", "--enable-scale-out",
            "--block-size", "128"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
    try:
        lines = [proc.stdout.readline().split() for _ in range(2)]
        assert [name for name, _ in lines] == ["pod-0", "pod-1"]
        for name, url in lines:
            assert url.startswith("http://127.0.0.1:")
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
                assert r.headers["x-sim-pod"] == name
                assert [m["id"] for m in json.load(r)["data"]][1:] == ["a", "b"]
            request = urllib.request.Request(url + "/v1/completions", data=json.dumps(
                {"model": "a", "prompt": "hi", "max_tokens": 3}).encode(), headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=5) as r:
                assert json.load(r)["usage"]["completion_tokens"] == 3
            render = urllib.request.Request(url + "/v1/completions/render", data=json.dumps(
                {"model": "a", "prompt": "hi"}).encode(), headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(render, timeout=5) as r:  # --enable-scale-out: 200, not 403
                assert len(json.load(r)[0]["token_ids"]) == 2  # BOS + "hi"
            with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
                assert 'block_size="128"' in r.read().decode()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_rejects_an_impossible_config() -> None:
    args = [sys.executable, "-m", "epp.sim", "--num-gpu-blocks", "1", "--max-model-len", "1024"]
    result = subprocess.run(args, capture_output=True, text=True, cwd=REPO, timeout=30,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 2 and "cannot hold" in result.stderr


def test_cli_publishes_kv_events_on_the_port_plus_the_pod_index() -> None:
    config = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*",
                         "replay_endpoint": "tcp://127.0.0.1:*", "topic": "kv@127.0.0.1@m"})
    args = [sys.executable, "-m", "epp.sim", "--pods", "2", "--kv-events-config", config]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
    try:
        lines = [proc.stdout.readline().split() for _ in range(2)]
        for _name, url, events, replay in lines:
            assert events.startswith("kv-events=tcp://127.0.0.1:") and replay.startswith("kv-replay=tcp://127.0.0.1:")
            with urllib.request.urlopen(url + "/kv_event_sources", timeout=5) as r:
                source = json.load(r)["0"]
            assert source["endpoint"] == events.removeprefix("kv-events=") and source["topic"] == "kv@127.0.0.1@m"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_rejects_a_bad_kv_events_config() -> None:
    for config, message in (("{", "not JSON"), ('{"endpont": "x"}', "unknown field 'endpont'"),
                            ('{"hwm": "1"}', "hwm must be int")):
        result = subprocess.run([sys.executable, "-m", "epp.sim", "--kv-events-config", config], capture_output=True,
                                text=True, cwd=REPO, timeout=30, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert result.returncode == 2 and message in result.stderr, result.stderr


def test_cli_names_the_tokenizer_file_it_cannot_read(tmp_path: Path) -> None:
    args = [sys.executable, "-m", "epp.sim", "--tokenizer", str(tmp_path)]
    result = subprocess.run(args, capture_output=True, text=True, cwd=REPO, timeout=30,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 2 and "tokenizer.json" in result.stderr
