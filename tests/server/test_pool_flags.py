"""The static pool's flags (epp.server.pool_flags): URLs named as such, labels separated by spaces."""

from __future__ import annotations

from pathlib import Path

import pytest

from epp.server.flags import FlagError
from epp.server.pool_flags import ENDPOINTS_FILE_HELP, static_endpoints


def test_flag_and_file_add_up_with_the_files_labels(tmp_path: Path) -> None:
    path = tmp_path / "pool.txt"
    path.write_text("# the pool\n10.0.0.2:8000 zone=a inference.networking.k8s.io/engine-type=sglang\n\n")
    endpoints = static_endpoints("10.0.0.1:8000", str(path))
    assert [e.hostport for e in endpoints] == ["10.0.0.1:8000", "10.0.0.2:8000"]
    assert dict(endpoints[1].labels) == {"zone": "a", "inference.networking.k8s.io/engine-type": "sglang"}


@pytest.mark.parametrize(
    ("flag_text", "line", "message", "hint"),
    [
        ("https://10.0.0.1:8443/v1", "", "--endpoints: 'https://10.0.0.1:8443/v1' is a URL", "e.g. 10.0.0.1:8443"),
        ("", "http://10.0.0.1:8000", "--endpoints-file: 'http://10.0.0.1:8000' is a URL", "e.g. 10.0.0.1:8000"),
        ("", "10.0.0.1:8000 zone=a,tier=y", "label zone='a,tier=y' is not one key=value label", "zone=a tier=y"),
        ("", "10.0.0.1:8000 zone=a=b", "label zone='a=b' is not one key=value label", "separate labels"),
    ],
)
def test_mistakes_are_named(tmp_path: Path, flag_text: str, line: str, message: str, hint: str) -> None:
    path = tmp_path / "pool.txt"
    path.write_text(line + "\n")
    with pytest.raises(FlagError) as info:
        static_endpoints(flag_text, str(path) if line else "")
    assert message in str(info.value) and hint in info.value.hint


def test_a_url_after_a_comment_sign_is_no_endpoint(tmp_path: Path) -> None:
    path = tmp_path / "pool.txt"
    path.write_text("10.0.0.1:8000  # was http://10.0.0.1:8000\n")
    assert [e.hostport for e in static_endpoints("", str(path))] == ["10.0.0.1:8000"]


def test_the_help_shows_the_label_syntax() -> None:
    assert "space-separated key=value" in ENDPOINTS_FILE_HELP and "zone=a,tier=y" in ENDPOINTS_FILE_HELP
