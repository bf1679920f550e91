"""Configuration of a simulated pod, and the cost model of an engine step.

:class:`EngineConfig` holds vLLM's scheduling knobs (``max_num_seqs``, ``max_num_batched_tokens``,
``num_gpu_blocks``, ``block_size``, ``max_model_len``, ``max_loras``), the served model and adapters, the
seed of the synthetic outputs, the time scale and the cost constants below.

Timing
------
One engine step takes (simulated seconds)::

    step = step_base_s
         + prefill_token_s * (prompt tokens computed in the step; cached ones cost nothing)
         + decode_seq_s    * (sequences decoding one token)
         + kv_read_token_s * (tokens of KV those sequences attend to)
         + lora_load_s     * (adapters loaded into a GPU slot for the step)

Defaults model Llama-3.1-8B-Instruct in bf16 on one H100-80GB (3.35 TB/s HBM, ~990 dense bf16 TFLOP/s):

* ``step_base_s`` 6 ms: a forward pass reads the 16 GB of weights (~4.8 ms at 3.35 TB/s) plus scheduling and
  sampling overhead, the ~6-7 ms batch-1 inter-token latency reported for this model and GPU;
* ``prefill_token_s`` 40 µs: 2 x 8e9 FLOP per token at ~400 TFLOP/s achieved (40% of peak), 25k tokens/s;
* ``decode_seq_s`` 80 µs per sequence: activations, sampling and per-sequence bookkeeping;
* ``kv_read_token_s`` 40 ns: each KV token is 128 KiB (32 layers x 8 KV heads x 128 dims x 2 (K, V) x 2 bytes),
  read once per decode step at 3.35 TB/s;
* ``lora_load_s`` 50 ms: copying a rank-16 adapter (~50-100 MB) into a GPU slot plus kernel metadata setup.

Together: ~7 ms inter-token latency alone, ~37 ms with 256 sequences of 1k tokens, ~0.33 s to prefill 8k tokens.
vLLM defaults: ``max_num_seqs`` 256, ``max_num_batched_tokens`` 8192 (V1 on an H100 for the API server),
``max_loras`` 1, ``block_size`` 16. ``num_gpu_blocks`` 16384 (262k tokens) is a smaller KV budget than the
H100 would have (~28k blocks), to keep cache pressure realistic with a moderate number of prompts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from typing import Any

from epp.prefix.kvwire import rank_endpoint
from epp.sim.kvcache import BLOCK_SIZE

__all__ = ["EngineConfig", "KVEventsConfig"]


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` (``vllm/config/kv_events.py``, 0.32): the same fields, defaults and
    JSON form, plus the simulator's ``array_events`` (its own flag ``--kv-events-arrays``: events as
    the arrays of releases before 0.11, tag first, instead of maps).

    ``endpoint`` is bound when it has ``*`` or ``::`` or is ``ipc://``/``inproc://`` (vLLM's rule),
    connected to otherwise; ``replay_endpoint`` (a ROUTER) is always bound. In one simulator process
    pod ``i`` publishes on the port + ``i`` (as vLLM's data-parallel rank ``i`` does; a wildcard
    port ``*`` or 0 is left to the system): :meth:`for_pod`.
    """

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    array_events: bool = False

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def parse(cls, text: str) -> KVEventsConfig:
        """The JSON object of ``--kv-events-config``; ValueError naming what is wrong (as vLLM refuses
        unknown fields and wrong types)."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = {f.name: f for f in fields(cls) if f.name != "array_events"}
        values: dict[str, Any] = {}
        for key, value in raw.items():
            if key not in known:
                raise ValueError(f"--kv-events-config: unknown field {key!r} (fields: {', '.join(known)})")
            kind = _FIELD_TYPES.get(key, str)
            ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
            if key == "replay_endpoint" and value is None:
                ok = True
            if not ok:
                raise ValueError(f"--kv-events-config: {key} must be {kind.__name__}, got {value!r}")
            values[key] = value
        if "publisher" not in values:  # vLLM: zmq when events are enabled, else null
            values["publisher"] = "zmq" if values.get("enable_kv_cache_events") else "null"
        if values["publisher"] not in ("null", "zmq"):
            raise ValueError(f"--kv-events-config: unknown publisher {values['publisher']!r} (null, zmq)")
        return cls(**values)

    def for_pod(self, index: int) -> KVEventsConfig:
        """This configuration with the ports of pod ``index`` (port + index, as a DP rank's)."""
        replay = self.replay_endpoint
        return replace(self, endpoint=rank_endpoint(self.endpoint, index),
                       replay_endpoint=rank_endpoint(replay, index) if replay else replay)

    def as_json(self, endpoint: str, replay_endpoint: str | None) -> dict[str, object]:
        """What ``/kv_event_sources`` shows for the publisher: vLLM's fields, endpoints resolved."""
        return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
                "replay_endpoint": replay_endpoint, "buffer_steps": self.buffer_steps, "hwm": self.hwm,
                "max_queue_size": self.max_queue_size, "topic": self.topic}


_FIELD_TYPES: dict[str, type] = {"enable_kv_cache_events": bool, "buffer_steps": int, "hwm": int, "max_queue_size": int}


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Configuration of one simulated pod (see the module docstring for the meaning of the constants)."""

    model: str = "meta-llama/Llama-3.1-8B-Instruct"
    tokenizer: str | None = None
    """A model directory (``tokenizer.json``, chat template): prompts are tokenized by it, as the
    picker's precise producer tokenizes them (:func:`epp.sim.tokens.model_prompts`); None: the
    simulator's own 4-bytes-per-token stand-in."""
    lora_adapters: tuple[str, ...] = ()
    max_loras: int = 1
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    num_gpu_blocks: int = 16384
    block_size: int = BLOCK_SIZE
    max_model_len: int = 131072  # Llama 3.1's context length
    time_scale: float = 1.0
    seed: int = 0
    step_base_s: float = 0.006
    prefill_token_s: float = 40e-6
    decode_seq_s: float = 80e-6
    kv_read_token_s: float = 40e-9
    lora_load_s: float = 0.05
    mean_output_tokens: int = 256  # mean length until end-of-sequence when max_tokens allows it
    default_max_tokens: int = 16  # OpenAI's default for completions; used for chat too
    enable_lora: bool = False  # implied by lora_adapters; alone it allows adapters loaded at runtime only
    enable_scale_out: bool = False  # vLLM's --enable-scale-out: the render endpoints answer instead of 403
    kv_events: KVEventsConfig | None = None
    """The pod's KV-event publisher (vLLM's ``--kv-events-config``); ``/kv_event_sources`` reports it.
    None (or not enabled): KV events off, ``/kv_event_sources`` is ``{}``."""

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_num_seqs", "max_num_batched_tokens", "num_gpu_blocks", "block_size",
                     "max_model_len", "mean_output_tokens", "default_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self.time_scale > 0:
            raise ValueError(f"time_scale must be positive, got {self.time_scale}")
        if self.num_gpu_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache ({self.num_gpu_blocks} blocks of {self.block_size} tokens) cannot hold one request "
                f"of max_model_len={self.max_model_len} tokens"
            )
        if self.model in self.lora_adapters or len(set(self.lora_adapters)) != len(self.lora_adapters):
            raise ValueError(f"adapter names must be unique and differ from the base model: {self.lora_adapters}")

    @property
    def lora_enabled(self) -> bool:
        """Whether LoRA is on (vLLM's ``--enable-lora``): adapters configured or allowed at runtime."""
        return self.enable_lora or bool(self.lora_adapters)
