"""A static endpoints file names where each endpoint publishes its KV-cache events (epp.datalayer.static)."""

from __future__ import annotations

from pathlib import Path

import pytest

from epp.datalayer.static import read_endpoints_file


def test_kv_events_and_kv_replay_are_ports_not_labels(tmp_path: Path) -> None:
    path = tmp_path / "pool.txt"
    path.write_text("10.0.0.7:8000 kv-events=5557 kv-replay=5558 zone=a\n10.0.0.8:8000 zone=b\n[fd00::1]:8000 kv-events=6000\n"
                    "10.0.0.9:8000 kv-replay=5558\n")  # the replay socket alone: for a picker that binds
    a, b, c, d = read_endpoints_file(path)
    assert (a.kv_events_port, a.kv_replay_port, dict(a.labels)) == (5557, 5558, {"zone": "a"})
    assert (b.kv_events_port, b.kv_replay_port, dict(b.labels)) == (0, 0, {"zone": "b"})
    assert (c.kv_events_port, c.kv_replay_port, dict(c.labels)) == (6000, 0, {})
    assert (d.kv_events_port, d.kv_replay_port, dict(d.labels)) == (0, 5558, {})


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("10.0.0.7:8000 kv-events=x", "kv-events='x': the port must be 1-65535"),
        ("10.0.0.7:8000 kv-events=70000", "the port must be 1-65535"),
    ],
)
def test_bad_ports_are_errors_naming_the_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "pool.txt"
    path.write_text(f"# pool\n{line}\n")
    with pytest.raises(ValueError, match=f"pool.txt:2: .*{message}"):
        read_endpoints_file(path)
