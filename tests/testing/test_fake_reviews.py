"""The fake API server's TokenReview and SubjectAccessReview (epp.testing.fake_reviews), over raw HTTP."""

from __future__ import annotations

import aiohttp

from epp.testing.fake_apiserver import FakeApiServer
from epp.testing.fake_reviews import SUBJECT_ACCESS_REVIEWS, TOKEN_REVIEWS
from tests.conftest import TOKEN

AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def test_reviews_answer_the_object_with_its_status(api: FakeApiServer) -> None:
    api.reviews.tokens["t"] = "alice"
    api.reviews.groups_of["alice"] = ["team"]
    api.reviews.allow("team", "/debug/*")
    async with aiohttp.ClientSession(headers=AUTH) as session:
        review = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": {"token": "t"}}
        async with session.post(api.url + TOKEN_REVIEWS, json=review) as response:
            assert response.status == 201
            body = await response.json()
        assert body["kind"] == "TokenReview" and body["status"]["authenticated"] is True
        assert body["status"]["user"]["groups"] == ["system:authenticated", "team"]
        for path, allowed in (("/debug/pool", True), ("/metrics", False)):
            spec = {"user": "alice", "groups": ["team"], "nonResourceAttributes": {"path": path, "verb": "get"}}
            async with session.post(api.url + SUBJECT_ACCESS_REVIEWS, json={"spec": spec}) as response:
                assert (await response.json())["status"]["allowed"] is allowed
        async with session.post(api.url + TOKEN_REVIEWS, json={"spec": {"token": "other"}}) as response:
            assert (await response.json())["status"]["authenticated"] is False


async def test_bad_review_requests_get_a_status(api: FakeApiServer) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.post(api.url + TOKEN_REVIEWS, json={"spec": {"token": "t"}}) as response:
            assert response.status == 401  # the caller's own credentials come first
        session.headers.update(AUTH)
        async with session.get(api.url + TOKEN_REVIEWS) as response:
            assert response.status == 405
        async with session.post(api.url + SUBJECT_ACCESS_REVIEWS, data=b"not json") as response:
            assert response.status == 400 and (await response.json())["kind"] == "Status"
        api.reviews.forbidden = True
        async with session.post(api.url + TOKEN_REVIEWS, json={"spec": {"token": "t"}}) as response:
            assert response.status == 403 and "tokenreviews" in (await response.json())["message"]
    assert api.reviews.call_count(TOKEN_REVIEWS) == 1 and api.reviews.call_count(SUBJECT_ACCESS_REVIEWS) == 0
