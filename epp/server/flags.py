"""Command-line flags parsed the way Go's ``flag`` package parses them.

The upstream Endpoint Picker is a Go binary, and Helm charts pass it Go-style arguments; a drop-in
replacement must accept exactly those forms:

* ``-name`` and ``--name`` are the same flag;
* a value follows as ``-name=value`` or as the next argument ``-name value``;
* a boolean takes its value only with ``=`` (``-secure-serving=false``); a bare ``-name`` means true,
  and ``-name false`` leaves ``false`` as a positional argument, as in Go;
* parsing stops at ``--`` or at the first argument that is not a flag;
* an unknown flag or a bad value is an error that names it (exit status 2 from the CLI).

What Go does not do, and an operator needs: an unknown flag's error carries a did-you-mean for a
close flag name (:mod:`difflib`), and :meth:`FlagSet.positional_error` explains a positional left
behind by a boolean written ``-name false``. The hint rides beside the message (``FlagError.hint``)
so the message itself stays Go's.
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from epp.framework.parameters import Duration, format_duration, parse_duration

__all__ = ["Duration", "Flag", "FlagError", "FlagSet", "HelpRequested", "parse_duration", "print_usage_error"]

_TRUE = {"1", "t", "T", "TRUE", "true", "True"}
_FALSE = {"0", "f", "F", "FALSE", "false", "False"}


class FlagError(ValueError):
    """A usage error; ``hint`` (may be empty) says how to put it right."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.hint = hint


class HelpRequested(FlagError):
    """``-h``/``-help`` was given: print the usage (on stdout) and exit 0."""


@dataclass(frozen=True)
class Flag:
    name: str
    default: Any
    help: str
    kind: type = str  # bool, int, float, str
    implemented: bool = True  # accepted for compatibility, but has no effect yet


def _go_int(text: str) -> int | None:
    """Go's strconv.ParseInt(text, 0, 64): 0x/0o/0b prefixes, a bare leading 0 means octal, no spaces."""
    if not text or text != text.strip():
        return None
    digits = text.lstrip("+-")
    try:
        if len(digits) > 1 and digits[0] == "0" and digits[1].isdigit():
            value = int(text.replace(digits, "0o" + digits[1:], 1), 0)
        else:
            value = int(text, 0)
    except ValueError:
        return None
    return value if -(2**63) <= value < 2**63 else None


def _go_default(flag: Flag) -> str:
    if flag.kind is Duration:
        return format_duration(flag.default)
    if flag.kind is bool:
        return "true" if flag.default else "false"
    if flag.kind is str:
        return f'"{flag.default}"'
    return str(flag.default)


def _convert(flag: Flag, text: str) -> Any:
    if flag.kind is bool:
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise FlagError(f'invalid boolean value "{text}" for -{flag.name}: parse error')
    if flag.kind is int:
        value = _go_int(text)
        if value is None:
            raise FlagError(f'invalid value "{text}" for flag -{flag.name}: parse error')
        return value
    if flag.kind is Duration:
        try:
            return parse_duration(text)
        except ValueError:
            raise FlagError(f'invalid value "{text}" for flag -{flag.name}: parse error') from None
    if flag.kind is float:
        try:
            return float(text)
        except ValueError:
            raise FlagError(f'invalid value "{text}" for flag -{flag.name}: parse error') from None
    return text


class FlagSet:
    def __init__(self, program: str, flags: Sequence[Flag]) -> None:
        self.program = program
        self.flags = {flag.name: flag for flag in flags}

    def parse(self, argv: Sequence[str]) -> tuple[dict[str, Any], list[str], set[str]]:
        """Returns (values for every flag, positional arguments, names of flags given explicitly)."""
        values = {name: flag.default for name, flag in self.flags.items()}
        given: set[str] = set()
        args = list(argv)
        i = 0
        while i < len(args):
            arg = args[i]
            if arg == "--":
                i += 1
                break
            if len(arg) < 2 or not arg.startswith("-"):
                break
            name = arg[2:] if arg.startswith("--") else arg[1:]
            if not name or name.startswith("-") or name.startswith("="):
                raise FlagError(f"bad flag syntax: {arg}")
            name, has_value, value = name.partition("=")
            if name in ("h", "help"):
                raise HelpRequested("help requested")
            flag = self.flags.get(name)
            if flag is None:
                raise FlagError(f"flag provided but not defined: -{name}", self._did_you_mean(name))
            if not has_value:
                if flag.kind is bool:
                    value = "true"
                elif i + 1 < len(args):
                    i += 1
                    value = args[i]
                else:
                    raise FlagError(f"flag needs an argument: -{name}")
            if flag.kind is list:  # a repeatable flag: every use adds its comma-separated items
                values[name] = [*values[name], *(item.strip() for item in value.split(",") if item.strip())]
            else:
                values[name] = _convert(flag, value)
            given.add(name)
            i += 1
        return values, args[i:], given

    def _did_you_mean(self, name: str) -> str:
        # 0.75: close enough for a typo or a missing/extra word part (grpc-prot, metric-port), not
        # for a different flag that shares a prefix.
        close = difflib.get_close_matches(name, self.flags, n=1, cutoff=0.75)
        return f"did you mean --{close[0]}?" if close else ""

    def positional_error(self, argv: Sequence[str], positional: Sequence[str]) -> FlagError:
        """The error for arguments left after the flags: with a hint when a boolean flag was given a separate value."""
        message = f"unexpected argument(s): {' '.join(positional)}"
        before = list(argv)[: len(argv) - len(positional)]
        if before and positional[0] in _TRUE | _FALSE:
            name = before[-1].lstrip("-").partition("=")[0]
            flag = self.flags.get(name)
            if flag is not None and flag.kind is bool and "=" not in before[-1]:
                return FlagError(
                    message, f"a boolean flag takes its value only with '=': write --{name}={positional[0]}"
                )
        return FlagError(message)

    def usage(self) -> str:
        lines = [f"Usage of {self.program}:"]
        for name in sorted(self.flags):
            flag = self.flags[name]
            kind = "" if flag.kind is bool else f" {flag.kind.__name__.lower()}"
            note = "" if flag.implemented else " (accepted for compatibility; no effect yet)"
            lines.append(f"  -{name}{kind}\n    \t{flag.help}{note} (default {_go_default(flag)})")
        return "\n".join(lines)


def make_flag(name: str, default: Any, help: str, *, implemented: bool = True, kind: type | None = None) -> Flag:
    """A Flag whose kind follows its default's type."""
    return Flag(name=name, default=default, help=help, kind=kind or type(default), implemented=implemented)


def print_usage_error(program: str, exc: FlagError) -> int:
    """Print a usage error the one way every command does (the error, its hint, where help is); returns 2."""
    lines = [f"{program}: {exc}"]
    if exc.hint:
        lines.append(f"  {exc.hint}")
    lines.append(f"Run '{program} -h' for the list of flags.")
    print("\n".join(lines), file=sys.stderr)
    return 2
