"""A simulator of vLLM model servers, for tests, demos and benchmarks of routing quality.

One process serves N simulated pods on N ports of 127.0.0.1. Each pod runs a model of a vLLM engine
(:mod:`epp.sim.engine`): continuous batching with a waiting queue, a paged KV cache with an LRU prefix cache
(:mod:`epp.sim.kvcache`), chunked prefill whose cost is proportional to uncached prompt tokens, decode steps
that slow down with batch size and context, LoRA adapter slots with a load delay; behind vLLM's
OpenAI-compatible HTTP API (:mod:`epp.sim.server`) and its ``/metrics`` page (:mod:`epp.sim.metrics`).
Outputs (text, token counts, finish reasons) are a pure function of the seed and the request
(:mod:`epp.sim.tokens`), so a given sequence of requests also produces the same cache hits; latencies follow the
wall clock, which can be accelerated (``time_scale``).

In-process use::

    async with SimulatedPool(4, EngineConfig(time_scale=0.1, seed=1)) as pool:
        url = pool.url(0)              # http://127.0.0.1:PORT
        engine = pool[0].engine        # counters: engine.stats, engine.kv, engine.num_waiting, ...

From a shell: ``python -m epp.sim --pods 4 --base-port 0 --seed 1`` (see ``--help``).
"""

from epp.sim.config import EngineConfig
from epp.sim.engine import Engine
from epp.sim.kvcache import KVCache
from epp.sim.pool import SimulatedPod, SimulatedPool
from epp.sim.request import SimRequest

__all__ = ["Engine", "EngineConfig", "KVCache", "SimRequest", "SimulatedPod", "SimulatedPool"]
