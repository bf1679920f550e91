"""``GET /v1/models`` through the gateway: the union of the pool's model lists, answered by the picker.

Design
------
A model server lists only its own models, so a ``GET /v1/models`` routed to one pod omits the
adapters loaded on the others. As llm-d's ``models-responder`` does, the picker answers it itself
(an ext_proc ImmediateResponse, 200, ``application/json``) from the lists the model poller read
(:mod:`epp.datalayer.served`): OpenAI's list format, one card per model id, sorted by id. A card
is kept whole as its server sent it (``id``, ``object``, ``created``, ``owned_by``, ``root``,
``parent``, ``max_model_len``, ...), so a client still tells an adapter by its ``parent``; when
several pods list one id, the card of the first pod by name wins, so the answer is stable.

Unlike upstream (a 503 until some list is read), a picker that has read no list yet returns None
and the request is routed to a pod as any other, which answers with its own list: never worse
than the gateway without the picker. Only ``GET`` of ``/v1/models`` (a trailing slash and a query
string allowed) is answered; ``/v1/models/{id}`` and everything else route normally.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2

from epp.framework import Endpoint

__all__ = ["MODELS_PATH", "is_models_request", "models_answer", "models_union"]

MODELS_PATH = "/v1/models"

_JSON = base_pb2.HeaderValueOption(
    header=base_pb2.HeaderValue(key="content-type", raw_value=b"application/json"),
    append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
)
_encoder = msgspec.json.Encoder()


def is_models_request(headers: Mapping[str, str]) -> bool:
    """Whether the request is ``GET /v1/models`` (query string and a trailing slash ignored)."""
    if headers.get(":method") != "GET":
        return False
    path = headers.get(":path", "").split("?", 1)[0]
    return path.rstrip("/") == MODELS_PATH


def models_union(endpoints: Sequence[Endpoint]) -> list[Mapping[str, Any]] | None:
    """Every model card the pool lists, one per id, sorted by id; None when no list was read."""
    cards: dict[str, Mapping[str, Any]] = {}
    listed = False
    for endpoint in sorted(endpoints, key=lambda e: e.name):
        served = endpoint.served
        if not served.listed:
            continue
        listed = True
        for card in served.entries:
            cards.setdefault(card["id"], card)
    if not listed:
        return None
    return [cards[model] for model in sorted(cards)]


def models_answer(endpoints: Sequence[Endpoint]) -> pb.ProcessingResponse | None:
    """The ImmediateResponse answering ``GET /v1/models`` for the pool; None: route it to a pod."""
    cards = models_union(endpoints)
    if cards is None:
        return None
    body = _encoder.encode({"object": "list", "data": [dict(card) for card in cards]})
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=200),
            headers=pb.HeaderMutation(set_headers=[_JSON]),
            body=body,
            details="epp_models_union",
        )
    )
