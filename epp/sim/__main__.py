"""``python -m epp.sim``: serve simulated vLLM pods until SIGTERM or SIGINT.

Prints one line per pod, ``pod-<i> http://127.0.0.1:<port>``, once every pod listens, followed by
``kv-events=<endpoint>`` (and ``kv-replay=<endpoint>``) when the pod publishes KV events; exits 0 on
a signal.

``--kv-events-config`` takes vLLM's JSON (``{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://127.0.0.1:*", "replay_endpoint": ..., "topic": "kv@127.0.0.1@m"}``); pod ``i``
publishes on the endpoint's port + ``i`` (a ``*`` port: one the system picks), as vLLM's data-parallel
rank ``i`` would.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Sequence
from dataclasses import replace

import zmq

from epp.prefix.tokenize import TokenizerError
from epp.sim.config import EngineConfig, KVEventsConfig
from epp.sim.pool import SimulatedPool
from epp.sim.tokens import model_tokenizer

_DEFAULTS = EngineConfig()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m epp.sim", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--pods", type=int, default=1, help="number of simulated pods")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--base-port", type=int, default=0, help="pod i listens on base-port + i; 0 = ephemeral ports")
    p.add_argument("--seed", type=int, default=_DEFAULTS.seed, help="seed of the synthetic outputs")
    p.add_argument("--time-scale", type=float, default=_DEFAULTS.time_scale,
                   help="wall seconds per simulated second (0.1 = 10x faster)")
    p.add_argument("--model", default=_DEFAULTS.model, help="served (base) model name")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="tokenize prompts with this model directory's tokenizer.json and chat template "
                        "(as the picker's precise producer does); default: 4 bytes per token")
    p.add_argument("--lora-adapters", default="", help="comma-separated adapter names served by every pod")
    p.add_argument("--enable-lora", action="store_true", help="allow /v1/load_lora_adapter without adapters")
    p.add_argument("--enable-scale-out", action="store_true",
                   help="serve the render endpoints (/v1/completions/render, ...) instead of answering 403")
    p.add_argument("--max-loras", type=int, default=_DEFAULTS.max_loras, help="LoRA adapters in a batch / GPU slots")
    p.add_argument("--lora-load-time", type=float, default=_DEFAULTS.lora_load_s, help="seconds to load an adapter")
    p.add_argument("--max-num-seqs", type=int, default=_DEFAULTS.max_num_seqs, help="running requests per pod")
    p.add_argument("--max-num-batched-tokens", type=int, default=_DEFAULTS.max_num_batched_tokens,
                   help="tokens per engine step")
    p.add_argument("--num-gpu-blocks", type=int, default=_DEFAULTS.num_gpu_blocks, help="KV blocks per pod")
    p.add_argument("--block-size", type=int, default=_DEFAULTS.block_size,
                   help="tokens per KV block (16: vLLM on GPU; 128: vLLM on CPU)")
    p.add_argument("--max-model-len", type=int, default=_DEFAULTS.max_model_len, help="context length")
    p.add_argument("--name", default="pod", help="pod i is named NAME-i (NAME alone with --pods 1 and a name given)")
    p.add_argument("--fault-control", action="store_true",
                   help="test only: serve PUT /sim/faults/metrics, which breaks the metrics page on demand "
                        "(see epp.sim.faults)")
    p.add_argument("--record", metavar="FILE",
                   help="test only: append one JSON line per request received to FILE (see epp.sim.faults)")
    p.add_argument("--mean-output-tokens", type=int, default=_DEFAULTS.mean_output_tokens,
                   help="mean output length when max_tokens allows (end-of-sequence probability 1/this)")
    p.add_argument("--kv-events-config", default=None,
                   help="vLLM's KV-event publisher settings as JSON (pod i publishes on the port + i)")
    p.add_argument("--kv-events-arrays", action="store_true",
                   help="publish KV events as the arrays of vLLM releases before 0.11, not as maps")
    return p


def _config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        tokenizer=args.tokenizer,
        lora_adapters=tuple(a for a in args.lora_adapters.split(",") if a),
        enable_lora=args.enable_lora,
        enable_scale_out=args.enable_scale_out,
        max_loras=args.max_loras,
        lora_load_s=args.lora_load_time,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_gpu_blocks=args.num_gpu_blocks,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        mean_output_tokens=args.mean_output_tokens,
        time_scale=args.time_scale,
        seed=args.seed,
    )


def _configs(args: argparse.Namespace) -> EngineConfig | list[EngineConfig]:
    config = _config(args)
    if args.kv_events_config is None:
        if args.kv_events_arrays:
            raise ValueError("--kv-events-arrays needs --kv-events-config")
        return config
    events = replace(KVEventsConfig.parse(args.kv_events_config), array_events=args.kv_events_arrays)
    return [replace(config, kv_events=events.for_pod(i)) for i in range(args.pods)]


async def _serve(pool: SimulatedPool) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await pool.start()
    except zmq.ZMQError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        for pod in pool:
            publisher = pod.engine.publisher
            extra = ""
            if publisher is not None:
                extra = f" kv-events={publisher.endpoint}"
                if publisher.replay_endpoint is not None:
                    extra += f" kv-replay={publisher.replay_endpoint}"
            print(f"{pod.name} {pod.url}{extra}", flush=True)
        await stop.wait()
    finally:
        await pool.stop()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.tokenizer is not None:
            model_tokenizer(args.tokenizer)  # a broken directory stops start-up, naming the file
        names = [args.name] if args.pods == 1 and args.name != "pod" else [f"{args.name}-{i}" for i in range(args.pods)]
        pool = SimulatedPool(
            args.pods,
            _configs(args),
            base_port=args.base_port,
            host=args.host,
            names=names,
            fault_control=args.fault_control,
            record=args.record,
        )
    except (ValueError, TokenizerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(_serve(pool))


if __name__ == "__main__":
    sys.exit(main())
