"""``single-profile-handler``: the configuration has one scheduling profile; the request goes where it picks.

Upstream semantics: runs the one profile once; its result is the primary result. A configuration
with one profile and no profile handler gets this one implicitly.

No parameters.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from epp.scheduling.registry import Handle, check_parameters
from epp.scheduling.runner import SingleProfileHandler

__all__ = ["SingleProfileHandler", "single_profile_handler"]


def single_profile_handler(name: str, parameters: Mapping[str, Any], handle: Handle) -> SingleProfileHandler:
    check_parameters(name, parameters)
    return SingleProfileHandler(name)
