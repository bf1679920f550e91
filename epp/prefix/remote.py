"""Prompt token ids asked of an engine: vLLM's ``/tokenize``, or its render endpoints.

The fallback of :mod:`epp.prefix.tokenize` when the picker has no tokenizer files for a model. One
HTTP POST per request, on a shared keep-alive session (aiohttp), bounded by ``timeout``; the time
of every call (answered or not) goes to ``observe``. A **circuit breaker** keeps a slow or dead
tokenizer from adding its timeout to every request: after ``failures`` consecutive failures
(timeouts, connection errors, non-200 answers) it *opens* and every call fails at once
(:class:`RemoteError` ``"open"``) for ``cooldown`` seconds (doubled on each failed retry, up to 16×);
then one call is let through (*half-open*): its success closes the breaker, its failure opens it
again. A 4xx answer about the request itself (the engine's 400 for a bad body) is not the tokenizer
failing: it counts as a success for the breaker, and as ``"rejected"`` for the caller.

Modes:

``tokenize`` (default)
    ``POST {url}/tokenize`` with the fields of the request that change its ids (vLLM's
    ``TokenizeCompletionRequest`` / ``TokenizeChatRequest``: ``model``, ``prompt`` or ``messages``,
    ``add_special_tokens``, ``add_generation_prompt``, ``continue_final_message``, ``tools``,
    ``chat_template``, ``chat_template_kwargs``), answered ``{"tokens": [...]}``. A request using what
    ``/tokenize`` does not take (``documents``, ``reasoning_effort``, ``truncate_prompt_tokens``, a
    list of prompts) is :class:`RemoteError` ``"unsupported"`` rather than a wrong answer.
``render``
    ``POST {url}/v1/completions/render`` or ``/v1/chat/completions/render`` with the request body as
    it is (vLLM 0.32 answers them only with ``--enable-scale-out``; 403 otherwise), answered with the
    ``token_ids`` of a ``GenerateRequest`` (the first of a list, for completions).

Where the call is awaited: ``precise-prefix-cache-producer``'s ``prepare_data``, before admission
(see :mod:`epp.framework.roles`), never inside a synchronous scheduling step.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import msgspec
import numpy as np

__all__ = ["Breaker", "RemoteError", "RemoteTokenizer"]


class RemoteError(Exception):
    """The engine gave no ids; ``reason``: timeout, error, status, open, rejected, unsupported."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class Breaker:
    """Consecutive-failure circuit breaker (see the module docstring); ``clock`` for tests."""

    def __init__(self, failures: int = 5, cooldown: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.failures = max(1, failures)
        self.cooldown = cooldown
        self._clock = clock
        self._failed = 0
        self._open_until = 0.0
        self._backoff = 1
        self._trial = False  # a half-open call is under way
        self.opened = 0  # times it opened (a counter)

    @property
    def state(self) -> str:
        if self._failed < self.failures:
            return "closed"
        return "open" if self._clock() < self._open_until or self._trial else "half-open"

    def allow(self) -> bool:
        """Whether a call may go now (in half-open, the one trial call)."""
        state = self.state
        if state == "closed":
            return True
        if state == "half-open":
            self._trial = True
            return True
        return False

    def success(self) -> None:
        self._failed, self._backoff, self._trial = 0, 1, False

    def failure(self) -> None:
        self._failed += 1
        if self._failed >= self.failures:
            if self._trial:
                self._backoff = min(self._backoff * 2, 16)
            self._trial = False
            self._open_until = self._clock() + self.cooldown * self._backoff
            self.opened += 1


_Raw = msgspec.Raw | msgspec.UnsetType  # a field's JSON as it came, or absent


class _Tokenize(msgspec.Struct, omit_defaults=True):
    model: str | msgspec.UnsetType | None = msgspec.UNSET
    prompt: _Raw = msgspec.UNSET
    messages: _Raw = msgspec.UNSET
    add_special_tokens: _Raw = msgspec.UNSET
    add_generation_prompt: _Raw = msgspec.UNSET
    continue_final_message: _Raw = msgspec.UNSET
    tools: _Raw = msgspec.UNSET
    chat_template: _Raw = msgspec.UNSET
    chat_template_kwargs: _Raw = msgspec.UNSET


class _Unsupported(msgspec.Struct):
    documents: _Raw = msgspec.UNSET
    reasoning_effort: _Raw = msgspec.UNSET
    truncate_prompt_tokens: _Raw = msgspec.UNSET
    truncation_side: _Raw = msgspec.UNSET
    kv_transfer_params: _Raw = msgspec.UNSET


def _given(value: object) -> bool:
    return isinstance(value, msgspec.Raw) and bytes(value).strip() != b"null"


_DECODE_TOKENIZE = msgspec.json.Decoder(_Tokenize).decode
_DECODE_UNSUPPORTED = msgspec.json.Decoder(_Unsupported).decode
_ENCODE = msgspec.json.Encoder().encode


class _Tokens(msgspec.Struct):
    tokens: list[int]


class _Generate(msgspec.Struct):
    token_ids: list[int]


_DECODE_TOKENS = msgspec.json.Decoder(_Tokens).decode
_DECODE_GENERATE = msgspec.json.Decoder(_Generate | list[_Generate]).decode
_RENDER_PATHS = {"completions": "/v1/completions/render", "chat_completions": "/v1/chat/completions/render"}


def tokenize_body(api: str, body: bytes) -> bytes:
    """The ``/tokenize`` body for a request body (RemoteError ``unsupported`` when it cannot say it all)."""
    try:
        unsupported = _DECODE_UNSUPPORTED(body)
        fields = _DECODE_TOKENIZE(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise RemoteError("unsupported", f"body fields /tokenize cannot take as they are: {exc}") from exc
    given = [k for k in _Unsupported.__struct_fields__ if _given(getattr(unsupported, k))]
    if given:
        raise RemoteError("unsupported", f"/tokenize does not take {given}")
    fields.model = msgspec.UNSET  # ids do not depend on the adapter; the base model is on every pod
    if api == "completions":
        prompt = fields.prompt
        one_string = isinstance(prompt, msgspec.Raw) and bytes(prompt).lstrip().startswith(b'"')
        if not one_string or _given(fields.messages):
            raise RemoteError("unsupported", "/tokenize takes one string prompt")
        fields = _Tokenize(prompt=prompt, add_special_tokens=fields.add_special_tokens)
    elif api == "chat_completions":
        if not _given(fields.messages):
            raise RemoteError("unsupported", "a chat request without messages")
        fields.prompt = msgspec.UNSET
    else:
        raise RemoteError("unsupported", f"{api} requests have no prompt to tokenize")
    return _ENCODE(fields)


class RemoteTokenizer:
    """Token ids from an engine over HTTP, with a timeout and a circuit breaker."""

    def __init__(
        self,
        *,
        mode: str = "tokenize",
        timeout: float = 0.05,
        breaker: Breaker | None = None,
        observe: Callable[[float], None] | None = None,
    ) -> None:
        if mode not in ("tokenize", "render"):
            raise ValueError(f"mode must be tokenize or render, got {mode!r}")
        self.mode = mode
        self.timeout = timeout
        self.breaker = breaker if breaker is not None else Breaker()
        self._observe = observe
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=64, keepalive_timeout=30)
            self._session = aiohttp.ClientSession(connector=connector, skip_auto_headers=("User-Agent",))
        return self._session

    async def token_ids(self, base_url: str, api: str, body: bytes) -> np.ndarray:
        """The ids the engine at ``base_url`` (``http://host:port``) computes for the request body."""
        if self.mode == "render":
            path = _RENDER_PATHS.get(api)
            if path is None:
                raise RemoteError("unsupported", f"{api} requests have no render endpoint")
            payload = body
        else:
            path, payload = "/tokenize", tokenize_body(api, body)
        if not self.breaker.allow():
            raise RemoteError("open", "the tokenizer's circuit breaker is open")
        started = time.perf_counter()
        try:
            ids = await asyncio.wait_for(self._post(base_url + path, payload), self.timeout)
        except RemoteError as exc:
            if exc.reason == "rejected":
                self.breaker.success()
            else:
                self.breaker.failure()
            raise
        except TimeoutError as exc:
            self.breaker.failure()
            raise RemoteError("timeout", f"no answer from {base_url}{path} in {self.timeout:g} s") from exc
        except (aiohttp.ClientError, OSError) as exc:
            self.breaker.failure()
            raise RemoteError("error", f"{base_url}{path}: {exc!r}") from exc
        finally:
            if self._observe is not None:
                self._observe(time.perf_counter() - started)
        self.breaker.success()
        return ids

    async def _post(self, url: str, payload: bytes) -> np.ndarray:
        headers = {"Content-Type": "application/json"}
        async with self._client().post(url, data=payload, headers=headers) as reply:
            data = await reply.read()
            if reply.status != 200:
                about_request = 400 <= reply.status < 500 and reply.status not in (403, 404, 408, 429)
                reason = "rejected" if about_request else "status"
                raise RemoteError(reason, f"{url} answered {reply.status}: {data[:200]!r}")
        try:
            parsed: Any = _DECODE_TOKENS(data) if self.mode == "tokenize" else _DECODE_GENERATE(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise RemoteError("status", f"{url} answered something else than token ids: {exc}") from exc
        if isinstance(parsed, list):
            if not parsed:
                raise RemoteError("status", f"{url} answered no prompt")
            parsed = parsed[0]
        ids = parsed.tokens if isinstance(parsed, _Tokens) else parsed.token_ids
        return np.array(ids, dtype=np.uint32)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
