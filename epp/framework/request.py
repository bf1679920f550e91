"""What a plugin sees of one inference request, and the per-request data plugins share.

Design
------
An :class:`InferenceRequest` is built once, when its body has been read, and never changes after
(every field is known before the first plugin runs: the edge parses the body, the director resolves
the objective's priority). What does change during a request's life is the data plugins compute for
each other, in :attr:`InferenceRequest.state`: a :class:`RequestState`, keyed by typed
:class:`StateKey` objects rather than bare strings, so that a producer and its consumers agree on the
value's type, and a type checker sees it::

    MATCH: StateKey[PrefixMatch] = StateKey("prefix-cache-match")
    request.state[MATCH] = PrefixMatch(...)     # a producer
    match = request.state.get(MATCH)            # a consumer: PrefixMatch | None

A key's name is what plugins declare in ``produces``/``consumes`` (a key or its name), which startup
checks (see :mod:`epp.framework.roles`). Two keys with the same name are the same key.

:data:`Outcome` is how a routed request's response ended, as ``response_complete`` hooks receive it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Generic, Literal, TypeVar, overload

__all__ = ["Api", "InferenceRequest", "Outcome", "RequestState", "StateKey"]

T = TypeVar("T")

Outcome = Literal["complete", "error", "cancelled"]
"""``complete``: the response ended; ``error``: it failed (or the pod answered 5xx); ``cancelled``: the
client or the gateway went away first."""


class Api(enum.Enum):
    """The OpenAI-compatible API a request addresses (from its path)."""

    COMPLETIONS = "completions"
    CHAT_COMPLETIONS = "chat_completions"
    EMBEDDINGS = "embeddings"
    RESPONSES = "responses"
    OTHER = "other"


class StateKey(Generic[T]):
    """A typed key of :class:`RequestState`; equal to every other key of the same name."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        if not name:
            raise ValueError("a state key needs a name")
        self.name = name

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StateKey) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)

    def __repr__(self) -> str:
        return f"StateKey({self.name!r})"


class RequestState:
    """Per-request data plugins share, from parsing to the end of the response."""

    __slots__ = ("_data",)

    def __init__(self) -> None:
        self._data: dict[str, Any] = {}

    def __getitem__(self, key: StateKey[T]) -> T:
        value: T = self._data[key.name]
        return value

    def __setitem__(self, key: StateKey[T], value: T) -> None:
        self._data[key.name] = value

    def __delitem__(self, key: StateKey[Any]) -> None:
        del self._data[key.name]

    def __contains__(self, key: object) -> bool:
        return isinstance(key, StateKey) and key.name in self._data

    @overload
    def get(self, key: StateKey[T]) -> T | None: ...
    @overload
    def get(self, key: StateKey[T], default: T) -> T: ...
    def get(self, key: StateKey[T], default: T | None = None) -> T | None:
        return self._data.get(key.name, default)  # values are T by construction

    def names(self) -> Iterator[str]:
        """The names of the keys set (for logs and decision records)."""
        return iter(self._data)

    def __repr__(self) -> str:
        return f"RequestState({sorted(self._data)})"


_NO_HEADERS: Mapping[str, str] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    """One request as the scheduler sees it.

    Attributes:
        request_id: the ``x-request-id`` header Envoy sets ("" when absent).
        method, path: from the ``:method`` and ``:path`` pseudo-headers.
        headers: request headers, lower-case names (pseudo-headers included).
        api: which API the path addresses.
        model: the requested model ("" for body-less requests such as ``GET /v1/models``).
        adapter: the LoRA adapter the request names: the requested model unless it is one of the
            pool's base models; None when there is no model.
        prompt: the text used for prefix-cache affinity ("" when the body has none): chat messages
            rendered to one string, the same conversation always to the same text.
        stream: whether the client asked for a streamed (SSE) answer.
        cache_salt: vLLM's ``cache_salt``; prefix hashes must be salted with it.
        max_tokens: the requested output budget, when given.
        body_size: bytes of request body received.
        objective: the InferenceObjective the request names (``x-llm-d-inference-objective`` or
            ``x-gateway-inference-objective``); "" when none.
        priority: the objective's priority (0 by default; below 0 is sheddable).
        body: the request body as received, for the OpenAI APIs routing parses (b"" otherwise): a
            plugin that needs a field routing does not read (a tokenizer rendering the chat messages)
            decodes it itself.
        state: per-request data plugins share (see :class:`RequestState`).
    """

    request_id: str
    method: str
    path: str
    headers: Mapping[str, str] = field(default_factory=lambda: _NO_HEADERS)
    api: Api = Api.OTHER
    model: str = ""
    adapter: str | None = None
    prompt: str = ""
    stream: bool = False
    cache_salt: str | None = None
    max_tokens: int | None = None
    body_size: int = 0
    objective: str = ""
    priority: int = 0
    body: bytes = field(default=b"", compare=False, repr=False)
    state: RequestState = field(default_factory=RequestState, compare=False, repr=False)

    @property
    def prompt_tokens(self) -> int:
        """The prompt's length in tokens, estimated at 4 characters per token (no tokenizer here)."""
        return (len(self.prompt) + 3) // 4
