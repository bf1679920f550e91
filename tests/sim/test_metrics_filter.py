"""The simulator answers /metrics?name[]=... as vLLM's prometheus_client does: only those families."""

from __future__ import annotations

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from epp.sim import EngineConfig, SimulatedPool
from epp.sim.metrics import restrict_page


async def test_name_filter_restricts_the_page_to_the_named_families() -> None:
    config = EngineConfig(time_scale=0.05, max_model_len=4096, num_gpu_blocks=1024)
    async with SimulatedPool(1, config) as pool, aiohttp.ClientSession() as session:
        async with session.get(pool.url(0) + "/metrics") as response:
            whole = await response.read()
        query = "?name[]=vllm:num_requests_waiting&name[]=vllm:cache_config_info"
        async with session.get(pool.url(0) + "/metrics" + query) as response:
            restricted = await response.read()
    families = {f.name for f in text_string_to_metric_families(restricted.decode())}
    assert families == {"vllm:num_requests_waiting", "vllm:cache_config_info"}
    assert len(restricted) < len(whole) / 20


def test_restrict_page_keeps_headers_and_drops_longer_names() -> None:
    page = (
        b"# HELP a_total x\n# TYPE a_total counter\na_total 1\n"
        b"# HELP a x\n# TYPE a gauge\na{l=\"v\"} 2\na 3\n"
        b"# TYPE ab gauge\nab 4\n"
    )
    assert restrict_page(page, [b"a"]) == b'# HELP a x\n# TYPE a gauge\na{l="v"} 2\na 3\n'
    assert restrict_page(page, [b"zz"]) == b""
