"""The picker-process harness cleans up after itself."""

from __future__ import annotations

from pathlib import Path

import pytest

from epp.testing.harness import PickerProcess, child_pids


def test_stop_removes_the_log_file_and_keeps_its_tail_readable() -> None:
    picker = PickerProcess(["127.0.0.1:1"], extra_args=["--scrape-metrics=false"])
    picker.start()
    log = Path(picker.log_path)
    assert log.exists()
    picker.stop()
    assert not log.exists()
    assert "serving" in picker.log_tail(200).lower()  # the start-up lines survive the file
    picker.start()  # a restart gets a fresh log
    try:
        assert Path(picker.log_path) != log and Path(picker.log_path).exists()
    finally:
        picker.stop()
    assert not Path(picker.log_path).exists()


def test_env_reaches_the_picker_and_its_workers_over_the_callers_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPP_HARNESS_PROBE", "caller")
    monkeypatch.setenv("EPP_HARNESS_KEPT", "kept")
    picker = PickerProcess(
        ["127.0.0.1:1"], extra_args=["--scrape-metrics=false", "--workers=1"], env={"EPP_HARNESS_PROBE": "picker"}
    )
    picker.start()
    try:
        children = child_pids(picker.pid)
        assert children  # the worker (spawned before readiness)
        for pid in [picker.pid, *children]:
            environ = dict(
                item.partition("=")[::2] for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if item
            )
            assert environ["EPP_HARNESS_PROBE"] == "picker", pid
            assert environ["EPP_HARNESS_KEPT"] == "kept", pid
    finally:
        picker.stop()
