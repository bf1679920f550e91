"""epp.wire._fast.header_map: a ProcessingRequest's headers read from its bytes, as headers_of reads them
from the parsed message, or None (the caller then parses) for what it does not read plainly."""

from __future__ import annotations

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf.message import DecodeError
from hypothesis import given
from hypothesis import strategies as st

from epp.extproc.answers import headers_of
from epp.wire._fast import header_map

_FIELDS = {"request_headers": 2, "response_headers": 3}
_KEYS = st.sampled_from([":method", ":path", ":status", "content-type", "x-request-id", "é-key", ""]) | st.text(max_size=8)
_HEADER = st.tuples(
    _KEYS,
    st.none() | st.text(max_size=8),  # value (a string)
    st.none() | st.binary(max_size=8) | st.sampled_from([b"\xff\xfe", "é".encode(), b"ok"]),  # raw_value (bytes)
)


def _message(phase: str, headers: list[tuple[str, str | None, bytes | None]], eos: bool, extras: bool) -> pb.ProcessingRequest:
    message = pb.ProcessingRequest()
    http = getattr(message, phase)
    http.end_of_stream = eos
    for key, value, raw in headers:
        header = http.headers.headers.add()
        header.key = key
        if value is not None:
            header.value = value
        if raw is not None:
            header.raw_value = raw
    if extras:  # what Envoy sends beside them
        message.protocol_config.request_body_mode = 4
        message.metadata_context.filter_metadata["envoy.lb"].fields["x"].string_value = "y"
        message.attributes["a"].fields["b"].number_value = 1
        http.attributes["k"].fields["x"].string_value = "v"
    return message


@given(
    phase=st.sampled_from(sorted(_FIELDS)),
    headers=st.lists(_HEADER, max_size=12),
    eos=st.booleans(),
    extras=st.booleans(),
)
def test_a_message_as_upb_writes_it_is_read_as_headers_of_reads_it(
    phase: str, headers: list[tuple[str, str | None, bytes | None]], eos: bool, extras: bool
) -> None:
    message = _message(phase, headers, eos, extras)
    data = message.SerializeToString()
    assert header_map(data, _FIELDS[phase]) == headers_of(getattr(message, phase))
    other = 3 if _FIELDS[phase] == 2 else 2
    assert header_map(data, other) == {}  # (the other phase's: not there)


@given(
    first=st.lists(_HEADER, max_size=4),
    second=st.lists(_HEADER, max_size=4),
    cut=st.integers(0, 64),
    noise=st.binary(max_size=16),
)
def test_anything_else_is_read_the_same_or_left_to_the_parser(
    first: list[tuple[str, str | None, bytes | None]],
    second: list[tuple[str, str | None, bytes | None]],
    cut: int,
    noise: bytes,
) -> None:
    # Two messages written one after the other merge (the headers' lists are joined); a message cut
    # short or followed by noise may not parse at all. Whatever parses, header_map reads it as the
    # parser does or says None; nothing crashes.
    one = _message("request_headers", first, False, False).SerializeToString()
    two = _message("request_headers", second, True, True).SerializeToString()
    for data in (one + two, one[:cut], one + noise, noise + one, noise):
        try:
            parsed = pb.ProcessingRequest.FromString(data)
        except DecodeError:
            header_map(data, 2)  # (anything: the caller has parsed it first, and failed)
            continue
        got = header_map(data, 2)
        assert got is None or got == headers_of(parsed.request_headers)


def test_repeated_fields_of_a_header_are_left_to_the_parser() -> None:
    value = base_pb2.HeaderValue(key="a", raw_value=b"1").SerializeToString() + b"\x1a\x012"  # raw_value again
    headers = b"\x0a" + bytes([len(value)]) + value
    http = b"\x0a" + bytes([len(headers)]) + headers
    data = b"\x12" + bytes([len(http)]) + http
    assert headers_of(pb.ProcessingRequest.FromString(data).request_headers) == {"a": "2"}  # the last wins
    assert header_map(data, 2) is None
