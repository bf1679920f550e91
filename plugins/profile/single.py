"""``single-profile-handler``: the configuration has one scheduling profile; the request goes where it picks.

Upstream semantics: runs the one profile once; its result is the primary result. A configuration
with one profile and no profile handler behaves the same without it. Declares ``single_profile``, so
the runner skips calling it.

No parameters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from epp.framework import Endpoint, Handle, InferenceRequest, Profile, check_parameters

__all__ = ["SingleProfileHandler"]


class SingleProfileHandler:
    single_profile = True

    def __init__(self, name: str = "single-profile-handler") -> None:
        self.name = name

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> SingleProfileHandler:
        check_parameters(name, parameters)
        return cls(name)

    def pick_profiles(
        self, request: InferenceRequest, profiles: Mapping[str, Profile], results: Mapping[str, list[Endpoint]]
    ) -> Sequence[Profile]:
        if results:
            return ()
        if len(profiles) != 1:
            raise RuntimeError(f"{self.name}: needs exactly one scheduling profile, the config has {len(profiles)}")
        return tuple(profiles.values())

    def process_results(self, request: InferenceRequest, results: Mapping[str, list[Endpoint]]) -> str:
        return next(iter(results))
