"""The picker-process harness cleans up after itself."""

from __future__ import annotations

from pathlib import Path

from epp.testing.harness import PickerProcess


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
