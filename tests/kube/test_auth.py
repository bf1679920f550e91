"""TokenReview then SubjectAccessReview (epp.kube.auth), with the real client against the fake API server."""

from __future__ import annotations

from pathlib import Path

import pytest

from epp.kube.auth import Access, ReviewUnavailable, review_access
from epp.kube.client import api_client
from epp.testing.fake_apiserver import FakeApiServer
from epp.testing.fake_reviews import SUBJECT_ACCESS_REVIEWS, TOKEN_REVIEWS

USER = "system:serviceaccount:monitoring:prometheus"


@pytest.mark.parametrize(
    ("token", "grant", "expected"),
    [
        ("t1", ("get", "/metrics"), (Access.ALLOWED, USER)),
        ("t1", ("get", "/debug/*"), (Access.FORBIDDEN, USER)),  # a prefix grant for another path
        ("t1", ("list", "/metrics"), (Access.FORBIDDEN, USER)),  # another verb
        ("forged", ("get", "/metrics"), (Access.UNAUTHENTICATED, "")),
    ],
)
async def test_review_access(
    api: FakeApiServer, kubeconfig: Path, token: str, grant: tuple[str, str], expected: tuple[Access, str]
) -> None:
    api.reviews.tokens["t1"] = USER
    api.reviews.allow(USER, grant[1], grant[0])
    client = await api_client(str(kubeconfig), environ={})
    try:
        assert await review_access(client, token, "/metrics") == expected
    finally:
        await client.close()
    assert api.reviews.call_count(TOKEN_REVIEWS) == 1
    assert api.reviews.call_count(SUBJECT_ACCESS_REVIEWS) == (0 if token == "forged" else 1)


async def test_a_group_grant_allows_its_members(api: FakeApiServer, kubeconfig: Path) -> None:
    api.reviews.tokens["t1"] = USER
    api.reviews.groups_of[USER] = ["system:serviceaccounts:monitoring"]
    api.reviews.allow("system:serviceaccounts:monitoring", "/metrics")
    client = await api_client(str(kubeconfig), environ={})
    try:
        assert await review_access(client, "t1", "/metrics") == (Access.ALLOWED, USER)
    finally:
        await client.close()


async def test_reviews_the_picker_may_not_create_are_unavailable_not_refused(
    api: FakeApiServer, kubeconfig: Path
) -> None:
    api.reviews.tokens["t1"] = USER
    api.reviews.forbidden = True
    client = await api_client(str(kubeconfig), environ={})
    try:
        with pytest.raises(ReviewUnavailable, match="403"):
            await review_access(client, "t1", "/metrics")
        await api.stop()
        with pytest.raises(ReviewUnavailable, match="cannot reach the API server"):
            await review_access(client, "t1", "/metrics")
    finally:
        await client.close()
