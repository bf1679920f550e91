"""The model of one vLLM engine: continuous batching over a paged KV cache, in scaled real time.

What is simulated (vLLM v1's scheduler, simplified)
----------------------------------------------------
* **Queues.** New requests join a FCFS *waiting* queue. Each engine step first serves the *running* requests
  (in admission order), then admits waiting ones while fewer than ``max_num_seqs`` run and the step's token
  budget (``max_num_batched_tokens``) lasts. If the head of the queue does not fit in the KV cache, admission
  stops (strict FCFS), as in vLLM.
* **Admission.** A request is admitted only when every block of its known tokens fits (the cached prefix is
  reused; free cached blocks are evicted LRU to make room). vLLM v1 allocates chunk by chunk instead; taking
  the whole prompt at once keeps half-prefilled prompts from being preempted. The prefix lookup covers the
  prompt minus its last token (vLLM always recomputes the last token to get logits), in whole blocks.
  ``prefix_cache_queries`` grows by the request's token count and ``prefix_cache_hits`` by the reused tokens
  at each admission (again after a preemption, as in vLLM).
* **Chunked prefill.** A step computes at most ``max_num_batched_tokens`` tokens: one per decoding sequence,
  the rest as (chunks of) prompts. When all known tokens of a request are computed it samples one token.
* **Decode and preemption.** A decoding sequence needs a new block every ``block_size`` tokens. If none is
  free, the most recently admitted running request is preempted: its blocks are freed (full ones stay in the
  prefix cache) and it goes back to the front of the queue, to recompute prompt + output so far later (vLLM's
  recompute preemption). No request is admitted in a step that preempted.
* **LoRA.** The model name of a request is the base model or one of the configured adapters. The running set
  holds at most ``max_loras`` distinct adapters: a request for another adapter waits (later requests may pass
  it). The GPU has ``max_loras`` adapter slots (LRU); a step whose batch uses an adapter that is not in a slot
  loads it, which costs ``lora_load_s`` and delays the whole batch, as vLLM's model runner does.
* **Output.** See :mod:`epp.sim.tokens`: deterministic words and length from (seed, model, prompt).
* **Cost.** A step's duration is a linear function of its prefill tokens, decoding sequences, their KV and
  adapter loads (formula and constants in :mod:`epp.sim.config`).
* **KV events.** With ``config.kv_events`` enabled the engine publishes what its cache holds, as vLLM
  does (:mod:`epp.sim.kvevents`): the blocks a step computes become ``BlockStored`` (per request, the
  run of new full blocks with their token ids and the hash of the block before them, ``None`` for a
  first block; an adapter's name as ``lora_name`` and in ``extra_keys``), blocks evicted to make room
  ``BlockRemoved`` (queued when the step is scheduled, so they precede the stores that needed the
  room), :meth:`reset_prefix_cache` ``AllBlocksCleared``; the events of a step go out as one batch
  when it ends (vLLM: ``Scheduler.update_from_output``), so a reset made while the engine is idle is
  announced with its next step. A subscriber that follows the stream holds exactly the hashes of
  :meth:`KVCache.cached_hashes` (``tests/sim/test_engine_events.py``).

Clock
-----
Steps follow an ideal timeline in real time scaled by ``time_scale`` (0.1 = 10x faster than real): a step ends
``duration * time_scale`` after the previous one ended, so the ~1 ms granularity of asyncio timers does not
slow the model down (up to ``_MAX_LAG_S`` of lateness is caught up on the next step), but a step never starts
before the newest request it admits arrived. All metrics are in simulated seconds. The engine loop is one
asyncio task that sleeps when there is nothing to do.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass

import numpy as np
import zmq

from epp.sim.config import EngineConfig
from epp.sim.kvcache import KVCache, block_hashes, model_seed
from epp.sim.kvevents import KVEventPublisher
from epp.sim.request import RequestState, SimRequest, Sink
from epp.sim.stats import EngineStats, LoraInfoHistory
from epp.sim.tokens import plan_output

__all__ = ["Engine"]

_MAX_LAG_S = 0.002  # real seconds a step may start late and still be caught up (asyncio timers: ~1 ms granularity)


@dataclass(slots=True)
class _Step:
    items: list[tuple[SimRequest, int]]  # request, tokens computed for it in this step
    duration: float
    tokens: int
    latest_arrival: float  # the step cannot start before its newest request arrived


class Engine:
    """One simulated vLLM engine. Create it, :meth:`start` it inside a running event loop, :meth:`submit`
    requests from :meth:`new_request`, and :meth:`stop` it."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.kv = KVCache(config.num_gpu_blocks, config.block_size)
        self.publisher: KVEventPublisher | None = None
        """The KV-event publisher (from :meth:`start` while ``config.kv_events`` is enabled)."""
        # Prompt + planned output of each live request, while events are on (weak: a request built and
        # never submitted leaves nothing behind).
        self._sequences: weakref.WeakKeyDictionary[SimRequest, np.ndarray] = weakref.WeakKeyDictionary()
        self.stats = EngineStats(config.model, config.max_model_len)
        self.lora_info = LoraInfoHistory()
        """Label combinations (running, waiting) of ``vllm:lora_requests_info`` -> wall time last seen."""
        self.lora_loads = 0
        """Adapters loaded into a GPU slot so far."""
        self.version = 0
        """Increases whenever anything on the /metrics page may have changed."""
        self.peers: tuple[Engine, ...] = ()
        """The engines of the pool this one belongs to (itself included; set by SimulatedPool)."""
        self._adapters = set(config.lora_adapters)
        self._seeds = {m: model_seed(m) for m in (config.model, *config.lora_adapters)}
        # vLLM's lora_id in BlockStored: the adapter's int id, 1 for the first one loaded.
        self._lora_ids = {name: i + 1 for i, name in enumerate(config.lora_adapters)}
        self._waiting: deque[SimRequest] = deque()
        self._running: list[SimRequest] = []
        # Waiting requests once passed over for the LoRA budget, until admitted: vLLM's deferred_waiting
        # (v1/core/sched/scheduler.py), the reason="deferred" of vllm:num_requests_waiting_by_reason.
        self._deferred: set[SimRequest] = set()
        self._lora_counts: dict[RequestState, Counter[str]] = {RequestState.WAITING: Counter(),
                                                                RequestState.RUNNING: Counter()}
        self._resident_loras: OrderedDict[str, None] = OrderedDict()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._t0 = 0.0
        self._timeline = 0.0  # real (loop) time at which the last step ended on the ideal timeline
        self._prev_step_end = -1.0
        self._next_id = 0
        # No lora_requests_info series until the first engine step: vLLM 0.32 sets it when it records a step,
        # so an idle server with --enable-lora shows the family's HELP/TYPE lines and no sample.

    # -- state, for metrics and tests -----------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_deferred(self) -> int:
        """Waiting requests that were skipped for the LoRA budget and are not admitted yet."""
        return len(self._deferred)

    @property
    def adapters(self) -> tuple[str, ...]:
        """LoRA adapters this engine serves (configured and loaded at runtime), sorted."""
        return tuple(sorted(self._adapters))

    @property
    def resident_loras(self) -> tuple[str, ...]:
        """Adapters in a GPU slot, least recently used first."""
        return tuple(self._resident_loras)

    def running_loras(self) -> list[str]:
        return sorted(k for k, v in self._lora_counts[RequestState.RUNNING].items() if v > 0)

    def waiting_loras(self) -> list[str]:
        return sorted(k for k, v in self._lora_counts[RequestState.WAITING].items() if v > 0)

    def now(self) -> float:
        """Simulated seconds since :meth:`start`."""
        return self._sim(asyncio.get_running_loop().time())

    # -- lifecycle ------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine loop (call from inside the event loop), and its KV-event publisher if
        configured (zmq.ZMQError, naming the endpoint, if it cannot bind)."""
        if self._task is not None:
            raise RuntimeError("engine already started")
        events = self.config.kv_events
        if events is not None and events.enabled and self.publisher is None:
            try:
                self.publisher = KVEventPublisher(
                    events.endpoint, events.topic, replay_endpoint=events.replay_endpoint,
                    array_events=events.array_events, buffer_batches=events.buffer_steps, hwm=events.hwm,
                )
            except zmq.ZMQError as exc:
                raise zmq.ZMQError(exc.errno, f"KV events: cannot use {events.endpoint}: {exc}") from None
            self.kv.events = self.publisher
        self._t0 = self._timeline = asyncio.get_running_loop().time()
        self._task = asyncio.create_task(self._run(), name=f"sim-engine-{self.config.model}")

    async def stop(self) -> None:
        """Stop the loop and abort every unfinished request; close the publisher."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for req in [*self._running, *self._waiting]:
            self.abort(req)
        if self.publisher is not None:
            self.publisher.flush()
            self.publisher.close()
            self.publisher = None
            self.kv.events = None

    def kv_event_sources(self) -> dict[str, object]:
        """``/kv_event_sources``: the publisher's settings per data-parallel rank, ``{}`` when off."""
        events = self.config.kv_events
        if events is None or not events.enabled:
            return {}
        publisher = self.publisher
        endpoint, replay = events.endpoint, events.replay_endpoint
        if publisher is not None:  # a wildcard port reads as the port the system gave
            if "*" in endpoint.rpartition(":")[2] or endpoint.endswith(":0"):
                endpoint = publisher.endpoint
            if replay is not None and publisher.replay_endpoint is not None:
                replay = publisher.replay_endpoint
        return {"0": events.as_json(endpoint, replay)}

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """vLLM's ``reset_prefix_cache``: empty the prefix cache, which fails (False) while requests hold
        blocks unless ``reset_running_requests`` preempts them first (they are recomputed later)."""
        if reset_running_requests:
            while self._running:
                self._preempt(self._running.pop())
        done = self.kv.reset()
        if done:
            self.version += 1
        return done
    # -- adapters -------------------------------------------------------------------------------------------

    def load_adapter(self, name: str) -> bool:
        """Serve a new adapter (vLLM's runtime ``/v1/load_lora_adapter``); False if LoRA is off or the name is
        taken."""
        if not self.config.lora_enabled or name == self.config.model or name in self._adapters:
            return False
        self._adapters.add(name)
        self._seeds[name] = model_seed(name)
        self._lora_ids.setdefault(name, len(self._lora_ids) + 1)
        self.version += 1
        return True

    def unload_adapter(self, name: str) -> bool:
        """Stop serving an adapter; False if unknown. Requests already submitted for it still complete."""
        if name not in self._adapters:
            return False
        self._adapters.discard(name)
        self._resident_loras.pop(name, None)
        self.version += 1
        return True

    # -- requests -------------------------------------------------------------------------------------------

    def serves(self, model: str) -> bool:
        """Whether ``model`` names the base model or one of the served adapters."""
        return model == self.config.model or model in self._adapters

    def new_request(
        self, model: str, prompt_ids: np.ndarray, *, max_tokens: int | None, ignore_eos: bool, sink: Sink
    ) -> SimRequest:
        """Build a request; raises KeyError for an unknown model and ValueError for an invalid length."""
        if not self.serves(model):
            raise KeyError(model)
        cfg = self.config
        if max_tokens is None:
            max_tokens = cfg.default_max_tokens
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}.")
        if len(prompt_ids) == 0:
            raise ValueError("The prompt cannot be empty.")
        if len(prompt_ids) + max_tokens > cfg.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {cfg.max_model_len} tokens. However, you requested "
                f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the messages, {max_tokens} in the "
                "completion). Please reduce the length of the messages or completion."
            )
        plan = plan_output(prompt_ids, model=model, seed=cfg.seed, max_tokens=max_tokens, ignore_eos=ignore_eos,
                           mean_output_tokens=cfg.mean_output_tokens)
        sequence = np.concatenate((prompt_ids.astype(np.uint32, copy=False), plan.token_ids))
        hashes = block_hashes(sequence, self._seeds[model], cfg.block_size).tolist()
        self._next_id += 1
        lora = None if model == cfg.model else model
        req = SimRequest(f"{self._next_id}", model, lora, prompt_ids, max_tokens, plan, hashes, sink)
        if cfg.kv_events is not None and cfg.kv_events.enabled:
            self._sequences[req] = sequence
        return req

    def submit(self, req: SimRequest) -> None:
        """Queue a request built by :meth:`new_request`."""
        req.arrival_t = self.now()
        self._waiting.append(req)
        self._count_lora(req, RequestState.WAITING, 1)
        self.version += 1
        self._wake.set()

    def abort(self, req: SimRequest) -> None:
        """Drop an unfinished request (client went away); counts as ``finished_reason="abort"``."""
        if req.state is RequestState.WAITING:
            self._waiting.remove(req)
            self._deferred.discard(req)
            self._count_lora(req, RequestState.WAITING, -1)
        elif req.state is RequestState.RUNNING:
            self._running.remove(req)
            self._count_lora(req, RequestState.RUNNING, -1)
            self._release(req)
        else:
            return
        self._mark_finished(req, "abort", self.now())
        self.version += 1
        self._wake.set()  # freed blocks or a free slot may unblock the queue

    # -- the loop -------------------------------------------------------------------------------------------

    def _sim(self, loop_time: float) -> float:
        return (loop_time - self._t0) / self.config.time_scale

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        scale = self.config.time_scale
        while True:
            if not self._running and not self._waiting:
                self._wake.clear()
                await self._wake.wait()
                self._timeline = loop.time()
                continue
            start = max(self._timeline, loop.time() - _MAX_LAG_S)
            step = self._schedule(self._sim(start))
            self.version += 1
            if step is None:  # nothing can run until a request arrives or leaves
                self._wake.clear()
                await self._wake.wait()
                continue
            self._touch_lora_info()
            end = max(start, self._t0 + step.latest_arrival * scale) + step.duration * scale
            self._timeline = end
            await asyncio.sleep(max(end - loop.time(), 0.0))
            self._complete(step, self._sim(end))

    def _schedule(self, now: float) -> _Step | None:
        cfg = self.config
        bs = cfg.block_size
        budget = cfg.max_num_batched_tokens
        items: list[tuple[SimRequest, int]] = []
        prefill = decode = context = 0
        preempted = False
        latest_arrival = 0.0
        running = self._running
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            prefilling = req.num_computed < req.known
            n = min(req.known - req.num_computed, budget) if prefilling else 1
            need = -(-(req.num_computed + n) // bs) - req.n_blocks
            if need > 0:
                while not self.kv.grow(need):
                    victim = running.pop()
                    self._preempt(victim)
                    preempted = True
                    if victim is req:
                        break
                if req.state is not RequestState.RUNNING:
                    break
                req.n_blocks += need
            items.append((req, n))
            budget -= n
            if prefilling:
                prefill += n
            else:
                decode += 1
                context += req.num_computed
            i += 1

        if not preempted:
            loras = {r.lora for r in running if r.lora is not None}
            skipped: list[SimRequest] = []
            waiting = self._waiting
            while waiting and budget > 0 and len(running) < cfg.max_num_seqs:
                req = waiting[0]
                if req.lora is not None and req.lora not in loras and len(loras) >= cfg.max_loras:
                    skipped.append(waiting.popleft())
                    self._deferred.add(req)
                    continue
                if not self._admit(req, now):
                    break
                waiting.popleft()
                running.append(req)
                if req.lora is not None:
                    loras.add(req.lora)
                latest_arrival = max(latest_arrival, req.arrival_t)
                n = min(req.known - req.num_computed, budget)
                items.append((req, n))
                budget -= n
                prefill += n
            waiting.extendleft(reversed(skipped))

        if not items:
            return None
        loads = self._load_loras({r.lora for r, _ in items if r.lora is not None})
        duration = (
            cfg.step_base_s
            + cfg.prefill_token_s * prefill
            + cfg.decode_seq_s * decode
            + cfg.kv_read_token_s * context
            + cfg.lora_load_s * loads
        )
        return _Step(items, duration, prefill + decode, latest_arrival)

    def held_at_arrival(self, req: SimRequest) -> tuple[int, int]:
        """(tokens of ``req``'s prefix this engine holds now, the most any engine of its pool holds now),
        counted as admission counts them. What a router that knew every pod's cache at the request's
        arrival could have reused: a bound on routing alone, where the unlimited-cache oracle also asks
        for an eviction order no LRU engine has."""
        bs = self.config.block_size
        limit = (req.known - 1) // bs
        own = self.kv.count_hits(req.hashes, limit)
        best = max((e.kv.count_hits(req.hashes, limit) for e in self.peers if e is not self), default=0)
        return own * bs, max(own, best) * bs

    def _admit(self, req: SimRequest, now: float) -> bool:
        bs = self.config.block_size
        known = req.known
        n_hit = self.kv.count_hits(req.hashes, (known - 1) // bs)
        n_total = -(-known // bs)
        if not self.kv.admit(req.hashes, n_hit, n_total - n_hit):
            return False
        self._deferred.discard(req)
        self._count_lora(req, RequestState.WAITING, -1)
        self._count_lora(req, RequestState.RUNNING, 1)
        req.state = RequestState.RUNNING
        req.n_blocks = n_total
        req.n_registered = n_hit
        req.num_computed = n_hit * bs
        self.stats.prefix_cache_queries += known
        self.stats.prefix_cache_hits += n_hit * bs
        if req.prefix_hit_tokens is None:
            req.prefix_hit_tokens = n_hit * bs
            req.scheduled_t = max(now, req.arrival_t)
            req.sink.notify()
        return True

    def _load_loras(self, needed: set[str]) -> int:
        resident = self._resident_loras
        for name in sorted(needed & resident.keys()):
            resident.move_to_end(name)
        loads = 0
        for name in sorted(needed - resident.keys()):
            if len(resident) >= self.config.max_loras:
                del resident[next(k for k in resident if k not in needed)]
            resident[name] = None
            loads += 1
        self.lora_loads += loads
        return loads

    def _complete(self, step: _Step, now: float) -> None:
        stats = self.stats
        kv = self.kv
        publisher = self.publisher
        bs = self.config.block_size
        prev_end = self._prev_step_end
        in_step_itl = 0  # tokens whose previous token came at the end of the previous step: one shared ITL
        sampled = 0
        finished = False
        for req, n in step.items:
            if req.state is not RequestState.RUNNING:  # aborted during the step
                continue
            req.num_computed += n
            full = min(req.num_computed // bs, len(req.hashes))
            if publisher is None:
                while req.n_registered < full:
                    kv.register(req.hashes[req.n_registered])
                    req.n_registered += 1
            else:
                new_from = -1  # the run of blocks new to the cache, announced as one BlockStored
                while req.n_registered < full:
                    i = req.n_registered
                    if kv.register(req.hashes[i]):
                        if new_from < 0:
                            new_from = i
                    elif new_from >= 0:
                        self._announce(req, new_from, i)
                        new_from = -1
                    req.n_registered += 1
                if new_from >= 0:
                    self._announce(req, new_from, full)
            if req.num_computed < req.known:  # chunked prefill goes on next step
                continue
            req.num_output += 1
            sampled += 1
            if req.first_token_t is None:
                req.first_token_t = now
                stats.ttft.observe(now - req.arrival_t)
                stats.prompt_tokens += req.prompt_len
                stats.prompt_tokens_cached += req.prefix_hit_tokens or 0
            elif req.last_token_t == prev_end:
                in_step_itl += 1
            else:
                gap = now - req.last_token_t
                stats.itl.observe(gap)
            req.last_token_t = now
            if req.num_output >= len(req.plan.words):
                self._count_lora(req, RequestState.RUNNING, -1)
                self._release(req)
                self._mark_finished(req, req.plan.finish_reason, now)
                finished = True
            else:
                req.sink.notify()
        if in_step_itl:
            stats.itl.observe(now - prev_end, in_step_itl)
        stats.generation_tokens += sampled
        stats.iteration_tokens.observe(step.tokens)
        if finished:
            self._running = [r for r in self._running if r.state is RequestState.RUNNING]
        self._prev_step_end = now
        self._touch_lora_info()
        self.version += 1
        if publisher is not None:
            publisher.flush()  # the step's evictions and stores (and a reset before it) as one batch

    def _announce(self, req: SimRequest, start: int, end: int) -> None:
        """Publish blocks ``start..end-1`` of ``req`` as one BlockStored, as vLLM's ``cache_full_blocks``."""
        publisher = self.publisher
        sequence = self._sequences.get(req)
        if publisher is None or sequence is None:
            return
        bs = self.config.block_size
        lora = req.lora
        publisher.stored(
            req.hashes[start:end], req.hashes[start - 1] if start else None,
            sequence[start * bs : end * bs].tolist(), bs,
            lora_id=self._lora_ids.get(lora) if lora else None, lora_name=lora,
            extra_keys=[(lora,)] * (end - start) if lora else None,
        )

    def _preempt(self, req: SimRequest) -> None:
        self._release(req)
        self._count_lora(req, RequestState.RUNNING, -1)
        self._count_lora(req, RequestState.WAITING, 1)
        req.state = RequestState.WAITING
        req.num_computed = 0
        self._waiting.appendleft(req)
        self.stats.preemptions += 1

    def _release(self, req: SimRequest) -> None:
        self.kv.release(req.hashes[: req.n_registered], req.n_blocks - req.n_registered)
        req.n_blocks = req.n_registered = 0

    def _mark_finished(self, req: SimRequest, reason: str, now: float) -> None:
        self._sequences.pop(req, None)
        req.state = RequestState.FINISHED
        req.finish_reason = reason
        req.finish_t = now
        s = self.stats
        s.request_success[reason] += 1
        if reason != "abort" and req.scheduled_t is not None and req.first_token_t is not None:
            s.e2e.observe(now - req.arrival_t)
            s.queue.observe(req.scheduled_t - req.arrival_t)
            s.inference.observe(now - req.scheduled_t)
            s.prefill.observe(req.first_token_t - req.scheduled_t)
            s.decode.observe(now - req.first_token_t)
            s.prompt_len.observe(req.prompt_len)
            s.generation_len.observe(req.num_output)
            s.max_generation_len.observe(req.max_tokens)
            s.params_max_tokens.observe(req.max_tokens)
            s.params_n.observe(1)
            if req.num_output > 1:
                s.request_tpot.observe((now - req.first_token_t) / (req.num_output - 1))
        req.sink.notify()

    def _touch_lora_info(self) -> None:
        # At the start of a step (what the batch runs) and after it (what is left).
        if self.config.lora_enabled:
            self.lora_info.touch(",".join(self.running_loras()), ",".join(self.waiting_loras()))

    def _count_lora(self, req: SimRequest, state: RequestState, delta: int) -> None:
        if req.lora is not None:
            self._lora_counts[state][req.lora] += delta
