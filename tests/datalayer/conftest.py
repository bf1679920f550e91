"""Fixtures shared by the data layer's tests."""

from __future__ import annotations

import pytest

import epp.datalayer.page


@pytest.fixture(params=["index", "search"])
def page_reading(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test that uses it runs twice: as configured (small pages read by the one-pass index, the
    rest searched), then with every page searched, so that both ways of reading are held to the same tables."""
    if request.param == "search":
        monkeypatch.setattr(epp.datalayer.page, "_INDEX_MAX_BYTES", -1)
    return str(request.param)
