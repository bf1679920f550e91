"""May this bearer token GET this path? The API server's answer: TokenReview, then SubjectAccessReview.

This is what the upstream picker's metrics server asks (controller-runtime's
``filters.WithAuthenticationAndAuthorization``, behind ``--metrics-endpoint-auth``): the token is
sent to the API server in a ``TokenReview`` (``authentication.k8s.io/v1``); an authenticated user
is then checked with a ``SubjectAccessReview`` (``authorization.k8s.io/v1``) for the non-resource
URL, with the request's path and verb (``get`` for a scrape). RBAC grants that with a ClusterRole
rule ``nonResourceURLs: ["/metrics"], verbs: ["get"]``; the picker's own ServiceAccount needs
``create`` on ``tokenreviews`` and ``subjectaccessreviews`` to ask.

:func:`review_access` makes the two calls with the process' kubernetes_asyncio client (the same
credentials as discovery: kubeconfig, exec plugins, the rotated in-cluster token), on the client's
event loop. The answer is an :class:`Access`; an API server that cannot be asked (unreachable, a
timeout, an error status such as the picker's own ServiceAccount not being allowed to create
reviews) raises :class:`ReviewUnavailable`, so the caller refuses rather than guessing. Caching and
the HTTP side live with the metrics server (:mod:`epp.server.metrics_auth`).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kubernetes_asyncio.client import ApiClient

__all__ = ["Access", "ReviewUnavailable", "review_access"]


class Access(enum.Enum):
    ALLOWED = "allowed"
    UNAUTHENTICATED = "unauthenticated"  # the API server does not accept the token
    FORBIDDEN = "forbidden"  # a known user that RBAC does not allow


class ReviewUnavailable(Exception):
    """The API server could not be asked, or did not answer a review: the request cannot be decided."""


def _get(obj: Any, name: str) -> Any:
    return getattr(obj, name, None) if obj is not None else None


async def review_access(client: ApiClient, token: str, path: str, verb: str = "get") -> tuple[Access, str]:
    """Whether ``token``'s user may ``verb`` the non-resource URL ``path``; and the user name ("" if none)."""
    import aiohttp
    from kubernetes_asyncio import client as k8s
    from kubernetes_asyncio.client.exceptions import ApiException

    try:
        review = await k8s.AuthenticationV1Api(client).create_token_review(
            k8s.V1TokenReview(spec=k8s.V1TokenReviewSpec(token=token))
        )
        status = _get(review, "status")
        user = _get(status, "user")
        if not _get(status, "authenticated") or user is None:
            return Access.UNAUTHENTICATED, ""
        username = _get(user, "username") or ""
        access = await k8s.AuthorizationV1Api(client).create_subject_access_review(
            k8s.V1SubjectAccessReview(
                spec=k8s.V1SubjectAccessReviewSpec(
                    user=username,
                    uid=_get(user, "uid"),
                    groups=_get(user, "groups"),
                    extra=_get(user, "extra"),
                    non_resource_attributes=k8s.V1NonResourceAttributes(path=path, verb=verb),
                )
            )
        )
    except ApiException as exc:
        raise ReviewUnavailable(f"the API server answered {exc.status} {exc.reason}".rstrip()) from exc
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
        raise ReviewUnavailable(f"cannot reach the API server: {exc or type(exc).__name__}") from exc
    allowed = bool(_get(_get(access, "status"), "allowed"))
    return (Access.ALLOWED if allowed else Access.FORBIDDEN), username
