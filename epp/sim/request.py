"""One generation request as the engine tracks it, and the wake-up channel to the HTTP handler that waits on it."""

from __future__ import annotations

import asyncio
import enum

import numpy as np

from epp.sim.tokens import OutputPlan

__all__ = ["RequestState", "SimRequest", "Sink"]


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sink:
    """Wakes the one coroutine (an HTTP handler) that follows one or more requests."""

    __slots__ = ("_dirty", "_future")

    def __init__(self) -> None:
        self._dirty = False
        self._future: asyncio.Future[None] | None = None

    def notify(self) -> None:
        """Something changed (admitted, new tokens, finished)."""
        self._dirty = True
        fut = self._future
        if fut is not None and not fut.done():
            fut.set_result(None)

    async def wait(self) -> None:
        """Return once something changed since the previous call."""
        if not self._dirty:
            self._future = asyncio.get_running_loop().create_future()
            try:
                await self._future
            finally:
                self._future = None
        self._dirty = False


class SimRequest:
    """One generation request inside the engine. Times are simulated seconds since the engine started."""

    def __init__(
        self, request_id: str, model: str, lora: str | None, prompt_ids: np.ndarray, max_tokens: int,
        plan: OutputPlan, hashes: list[int], sink: Sink,
    ) -> None:
        self.request_id = request_id
        self.model = model
        self.lora = lora
        self.prompt_len = len(prompt_ids)
        self.max_tokens = max_tokens
        self.plan = plan
        self.hashes = hashes  # chained hashes of the full blocks of prompt + planned output
        self.sink = sink
        self.state = RequestState.WAITING
        self.num_output = 0  # tokens sampled so far
        self.num_computed = 0  # tokens whose KV is in the cache
        self.n_blocks = 0  # blocks held
        self.n_registered = 0  # leading held blocks that are registered in the prefix cache
        self.prefix_hit_tokens: int | None = None  # reused tokens at first admission
        self.finish_reason: str | None = None
        self.arrival_t = 0.0
        self.scheduled_t: float | None = None
        self.first_token_t: float | None = None
        self.last_token_t = 0.0
        self.finish_t: float | None = None

    @property
    def known(self) -> int:
        """Tokens that exist so far: prompt plus sampled output."""
        return self.prompt_len + self.num_output

    @property
    def finished(self) -> bool:
        return self.state is RequestState.FINISHED

    def text(self) -> str:
        """The text generated so far."""
        return "".join(self.plan.words[: self.num_output])
