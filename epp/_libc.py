"""glibc's own functions, for the few tunings only glibc's malloc has (``epp.server.process``'s arena cap,
``epp.prefix.tokenize``'s release after a long prompt). Here, below every layer, so both can use it."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable

__all__ = ["glibc_function"]


def glibc_function(name: str) -> Callable[..., int] | None:
    """The C library's ``name`` when that library is glibc and has it; None elsewhere (musl, macOS)."""
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
        function: Callable[..., int] = getattr(ctypes.CDLL(None), name)
    except (ValueError, OSError, AttributeError):  # not glibc (the name or its value unknown), or no such function
        return None
    return function
