"""TokenReview and SubjectAccessReview for the fake API server (:mod:`epp.testing.fake_apiserver`).

The two review APIs a delegating authenticator and authorizer call, at their real paths::

    POST /apis/authentication.k8s.io/v1/tokenreviews          {"spec": {"token": ...}}
    POST /apis/authorization.k8s.io/v1/subjectaccessreviews   {"spec": {"user", "groups", "nonResourceAttributes"}}

Each answers the object it was given with a ``status`` filled in, as the real API server does:
``authenticated`` and ``user`` (username, uid, groups) for a token in :attr:`AccessReviews.tokens`;
``allowed`` when the user (or one of its groups) has the (verb, path) in :attr:`AccessReviews.grants`.
A grant path ending in ``*`` is a prefix, as RBAC's ``nonResourceURLs``. Tests configure both
dictionaries directly, make the reviews themselves forbidden (the caller's ServiceAccount lacks
``create``) with :attr:`AccessReviews.forbidden`, and count calls in :attr:`AccessReviews.calls`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

__all__ = ["SUBJECT_ACCESS_REVIEWS", "TOKEN_REVIEWS", "AccessReviews"]

TOKEN_REVIEWS = "/apis/authentication.k8s.io/v1/tokenreviews"
SUBJECT_ACCESS_REVIEWS = "/apis/authorization.k8s.io/v1/subjectaccessreviews"


def _status_error(code: int, reason: str, message: str) -> web.Response:
    body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message}
    return web.json_response({**body, "reason": reason, "code": code}, status=code)


@dataclass
class AccessReviews:
    # token -> username (its groups: system:authenticated plus those in groups_of)
    tokens: dict[str, str] = field(default_factory=dict)
    groups_of: dict[str, list[str]] = field(default_factory=dict)
    # user or group -> the (verb, nonResourceURL) pairs it may do
    grants: dict[str, set[tuple[str, str]]] = field(default_factory=dict)
    forbidden: bool = False
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # (path, spec) of each review

    def allow(self, subject: str, path: str = "/metrics", verb: str = "get") -> None:
        self.grants.setdefault(subject, set()).add((verb, path))

    def call_count(self, path: str | None = None) -> int:
        return sum(1 for called, _ in self.calls if path is None or called == path)

    async def answer(self, request: web.Request) -> web.Response | None:
        """The response to a review request; None for any other request."""
        if request.path not in (TOKEN_REVIEWS, SUBJECT_ACCESS_REVIEWS):
            return None
        if request.method != "POST":
            return _status_error(405, "MethodNotAllowed", f"{request.method} is not supported on {request.path}")
        try:
            body = json.loads(await request.read())
            spec = body["spec"]
        except (ValueError, KeyError, TypeError):
            return _status_error(400, "BadRequest", "the body is not a review object with a spec")
        self.calls.append((request.path, spec))
        plural = request.path.rsplit("/", 1)[1]
        if self.forbidden:
            return _status_error(
                403,
                "Forbidden",
                f'{plural} is forbidden: User "system:serviceaccount:default:epp" cannot create resource "{plural}"',
            )
        status = self._token_status(spec) if request.path == TOKEN_REVIEWS else self._access_status(spec)
        return web.json_response({**body, "status": status}, status=201)

    def _token_status(self, spec: dict[str, Any]) -> dict[str, Any]:
        user = self.tokens.get(spec.get("token") or "")
        if user is None:
            return {"authenticated": False, "error": "invalid bearer token"}
        groups = ["system:authenticated", *self.groups_of.get(user, [])]
        return {"authenticated": True, "user": {"username": user, "uid": f"uid-{user}", "groups": groups}}

    def _access_status(self, spec: dict[str, Any]) -> dict[str, Any]:
        attributes = spec.get("nonResourceAttributes") or {}
        verb, path = attributes.get("verb", ""), attributes.get("path", "")
        for subject in (spec.get("user") or "", *(spec.get("groups") or [])):
            for granted_verb, granted in self.grants.get(subject, set()):
                matches = path.startswith(granted[:-1]) if granted.endswith("*") else path == granted
                if granted_verb in (verb, "*") and matches:
                    return {"allowed": True, "reason": f"granted to {subject}"}
        return {"allowed": False}
