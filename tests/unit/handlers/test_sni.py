"""``--verify-sni``'s parser and verifier in process (:mod:`aioslirp.handlers.sni`): the name a TLS
ClientHello or an HTTP/1 request head asks for, and every form a server could read as another name,
refused one rule at a time (issue 24). The real-guest test is in ``tests/system/test_handlers.py``.

Each refusal is checked by its reason, so that a test passes only when its own rule refuses the input.
"""

from __future__ import annotations

import asyncio
import ssl
import tracemalloc
import types

import pytest
from hypothesis import given, settings, strategies as st

from aioslirp import NetworkConfig
from aioslirp.flow.egress import Egress
from aioslirp.handlers.sni import MAX_HELD, MAX_REQUEST_LINE, Requests, SniVerifier, first_name


def why(data: bytes) -> str:
    """The reason ``data`` is refused (it must be)."""
    outcome, name, port = first_name(data)
    assert outcome not in ("name", "more", "none") and name is None and port is None, (outcome, name, port)
    return outcome


#: Every reason for a refusal, as the log line shows it (but the host-override field's, which names it).
REASONS = (
    "a TLS record that is not a handshake record before the ClientHello's end",
    "a TLS handshake record of length 0 or over 2^14 (RFC 8446 5.1)",
    "a TLS handshake message that is not a ClientHello",
    "a truncated ClientHello",
    "a ClientHello session id over 32 bytes (RFC 8446 4.1.2)",
    "a ClientHello whose extensions do not end where it does",
    "a ClientHello extension longer than the extensions",
    "a ClientHello extension twice (RFC 8446 4.2)",
    "an encrypted ClientHello (ECH/ESNI: the server reads the inner, hidden name)",
    "a server_name list whose length is not the extension's",
    "a server_name entry cut short",
    "a server_name entry that is not a host_name (RFC 6066 3)",
    "a host_name longer than its server_name list",
    "a server_name list without exactly one host_name (RFC 6066 3)",
    "a host_name that is not a host name (RFC 6066 3: ASCII letters, digits, hyphens, no trailing dot)",
    "a bare CR or LF in the request head (RFC 9112 2.2)",
    "not an HTTP/1 request line (RFC 9112 3)",
    "a control or non-ASCII byte in the request target",
    "a CONNECT target that is not host:port (RFC 9112 3.2.3)",
    "an origin-form target starting with // (an authority to some URL parsers)",
    "a request target neither origin-form nor absolute-form http(s) (RFC 9112 3.2)",
    "an absolute-form target whose authority is not host[:port] (no userinfo)",
    "a field line whose name is not a token followed by a colon (RFC 9112 5.1, 5.2)",
    "a control character in a field value (RFC 9110 5.5)",
    "two Host fields (RFC 9112 3.2)",
    "a Host that is not host[:port] (RFC 9110 7.2)",
    "a Host that is not the request target's host and port (RFC 9112 3.2)",
    "neither a TLS ClientHello nor an HTTP/1 request",
    "a request line over 8 KiB",
    "a Content-Length that is not one decimal number under 2^63 (RFC 9112 6.3)",
    "a Transfer-Encoding other than one chunked (RFC 9112 6.1)",
    "an Upgrade other than one websocket (h2c: HTTP/2 frames name any host, RFC 9113 8.3.1)",
    "a Transfer-Encoding with a Content-Length or in HTTP/1.0 (RFC 9112 6.1: read two ways)",
    "content on a CONNECT or Upgrade request (RFC 9110 9.3.6)",
)

#: The reasons only a later request or its content is refused for (by :class:`Requests`).
STREAM_REASONS = (
    "a request head over 16 KiB",
    "a CONNECT or Upgrade after the first request (its answer would not be told apart)",
    "a chunk size that is not 1 to 16 hex digits and CRLF (no chunk extension, RFC 9112 7.1)",
    "a chunk size over 2^63 - 1",
    "chunk data not followed by CRLF (RFC 9112 7.1)",
    "a last chunk not followed by CRLF alone (no trailer field, RFC 9112 7.1.2)",
    "over 16 KiB sent before the server answered a CONNECT or Upgrade",
)


def refused(part: str, data: bytes) -> bool:
    """``data`` is refused for the one reason of :data:`REASONS` containing ``part``, word for word."""
    (reason,) = [r for r in REASONS if part in r]
    return why(data) == reason


def request(head: bytes, line: bytes = b"GET / HTTP/1.1") -> bytes:
    return line + b"\r\n" + head + b"\r\n\r\n"


def host(value: bytes):
    return first_name(request(b"Host: " + value))


# ---------------------------------------------------------------------------------------- TLS


def client_hello(name: str | None) -> bytes:
    """The ClientHello Python's ssl module sends for ``server_hostname=name``."""
    ctx = ssl.create_default_context() if name else ssl._create_unverified_context()
    i, o = ssl.MemoryBIO(), ssl.MemoryBIO()
    t = ctx.wrap_bio(i, o, server_hostname=name)
    with pytest.raises(ssl.SSLWantReadError):
        t.do_handshake()
    return o.read()


def records(hs: bytes, *cuts: int, ctype: int = 22) -> bytes:
    """The handshake bytes ``hs`` in TLS records cut at ``cuts``."""
    out, start = b"", 0
    for end in (*cuts, len(hs)):
        out += bytes([ctype, 3, 1]) + (end - start).to_bytes(2, "big") + hs[start:end]
        start = end
    return out


def hello_body(exts: bytes | None, session_id: bytes = b"", tail: bytes = b"", suites: bytes = b"\x13\x01",
               compression: bytes = b"\x00") -> bytes:
    body = b"\x03\x03" + bytes(32) + bytes([len(session_id)]) + session_id + len(suites).to_bytes(2, "big") + suites \
        + bytes([len(compression)]) + compression
    if exts is not None:
        body += len(exts).to_bytes(2, "big") + exts
    return body + tail


def raw_hello(exts: bytes | None, **kw) -> bytes:
    """A minimal TLS 1.3 ClientHello carrying the extension bytes ``exts``, in records of 2^14 bytes."""
    body = hello_body(exts, **kw)
    hs = b"\x01" + len(body).to_bytes(3, "big") + body
    return records(hs, *range(16384, len(hs), 16384))


def ext(etype: int, data: bytes) -> bytes:
    return etype.to_bytes(2, "big") + len(data).to_bytes(2, "big") + data


def sni_list(*entries: tuple[int, bytes]) -> bytes:
    lst = b"".join(bytes([t]) + len(n).to_bytes(2, "big") + n for t, n in entries)
    return len(lst).to_bytes(2, "big") + lst


def sni_ext(*names: bytes) -> bytes:
    """A server_name extension (RFC 6066 3) listing ``names`` as host_name entries."""
    return ext(0, sni_list(*((0, n) for n in names)))


def test_a_real_client_hello_names_its_server_in_one_record_or_several():
    ch = client_hello("api.svc.test")
    assert first_name(ch) == ("name", "api.svc.test", None)
    hs = ch[5:]
    assert first_name(records(hs, 30)) == ("name", "api.svc.test", None)
    assert first_name(records(hs, 1, 2, 3, 200)) == ("name", "api.svc.test", None)  # the header split too
    assert first_name(client_hello(None)) == ("none", None, None)
    for n in (1, 4, 5, 40, len(ch) - 1):  # a ClientHello arriving in pieces: wait
        assert first_name(ch[:n]) == ("more", None, None), n
    assert first_name(records(hs, 30)[:60]) == ("more", None, None)
    assert first_name(b"") == ("more", None, None)
    assert first_name(ch + b"\x17\x03\x03\x00\x01x") == ("name", "api.svc.test", None)  # what follows is not read


def test_the_host_name_is_lower_cased():
    assert first_name(raw_hello(sni_ext(b"API.Svc.TEST"))) == ("name", "api.svc.test", None)
    assert first_name(raw_hello(sni_ext(b"a_b-c.test"))) == ("name", "a_b-c.test", None)


def test_records_that_are_not_handshake_records_are_refused():
    hs = client_hello("a.test")[5:]
    assert refused("neither a TLS", records(hs, ctype=21))  # an alert
    assert refused("not a handshake record", records(hs[:30]) + records(hs[30:], ctype=20))  # CCS inside it
    assert refused("not a handshake record", b"\x16\x02\x00" + records(hs)[3:])  # record version 2.0
    assert refused("length 0 or over 2^14", b"\x16\x03\x01\x00\x00" + records(hs))
    big = b"\x01" + (16385).to_bytes(3, "big") + bytes(16385)
    assert refused("length 0 or over 2^14", b"\x16\x03\x01\x40\x01" + big[:100])
    assert first_name(b"\x16\x03\x01\x40\x00" + big[:100]) == ("more", None, None)  # 2^14 itself is fine


def test_a_handshake_that_is_not_a_client_hello_is_refused():
    assert refused("not a ClientHello", b"\x16\x03\x01\x00\x05\x02\x00\x00\x01\x00")


def test_two_server_name_extensions_or_two_host_names_are_refused():
    """Two names: OpenSSL takes the first, Go refuses; RFC 6066 3 allows one per type."""
    assert first_name(raw_hello(sni_ext(b"a.test"))) == ("name", "a.test", None)
    assert refused("twice", raw_hello(sni_ext(b"a.test") + sni_ext(b"b.test")))
    assert refused("exactly one host_name", raw_hello(sni_ext(b"a.test", b"b.test")))
    assert refused("exactly one host_name", raw_hello(ext(0, sni_list())))


def test_any_extension_twice_is_refused():
    """RFC 8446 4.2: no two extensions of one type in a block (OpenSSL refuses the ClientHello)."""
    assert refused("twice", raw_hello(ext(10, b"\x00\x02\x00\x1d") + sni_ext(b"a.test") + ext(10, b"\x00\x02\x00\x17")))
    assert first_name(raw_hello(ext(10, b"\x00\x02\x00\x1d") + sni_ext(b"a.test"))) == ("name", "a.test", None)


def test_name_types_other_than_host_name_are_refused():
    """OpenSSL refuses a first entry that is not host_name; Go skips it: both readings differ from a guess."""
    assert refused("not a host_name", raw_hello(ext(0, sni_list((1, b"other.test"), (0, b"a.test")))))
    assert refused("not a host_name", raw_hello(ext(0, sni_list((0, b"a.test"), (1, b"other.test")))))


@pytest.mark.parametrize("name", [b"a.test.", b"", b".a.test", b"a..test", "\u00e9.test".encode(),
                                  b"a.test\x00.other.test", b"a.test/x", b"a test", b"a" * 64 + b".test",
                                  b"a.test:443", b"192.0.2.1%0"])
def test_host_names_that_are_not_host_names_are_refused(name):
    """RFC 6066 3: ASCII, no trailing dot (Go refuses one; a server comparing strings would miss
    the name and fall back to its default host)."""
    assert refused("not a host name", raw_hello(sni_ext(name)))


def test_a_253_byte_name_passes_and_254_does_not():
    name = b".".join([b"a" * 63] * 3 + [b"b" * 61])
    assert len(name) == 253 and first_name(raw_hello(sni_ext(name)))[1] == name.decode()
    assert refused("not a host name", raw_hello(sni_ext(name + b"b")))


def test_server_name_lengths_that_disagree_are_refused():
    entry = b"\x00\x00\x06a.test"
    assert refused("list whose length", raw_hello(ext(0, b"\x00\x08" + entry)))  # list says 8, has 9
    assert refused("cut short", raw_hello(ext(0, b"\x00\x0a" + entry + b"\x00")))  # an extra byte
    assert refused("list whose length", raw_hello(ext(0, b"\x00")))
    assert refused("list whose length", raw_hello(ext(0, b"")))  # a server's empty echo
    assert refused("longer than its server_name list", raw_hello(ext(0, b"\x00\x09\x00\x00\x07a.test")))
    assert refused("cut short", raw_hello(ext(0, b"\x00\x0b" + entry + b"\x00\x00")))  # a cut entry
    # the extension's own length: another name hidden after the list
    assert refused("list whose length", raw_hello(ext(0, b"\x00\x09" + entry + b"\x00\x00\x0aother.test")))


def test_extension_lengths_that_disagree_are_refused():
    good = sni_ext(b"a.test")
    body = hello_body(good)
    bad = body[:-len(good)] + good[:2] + (len(good)).to_bytes(2, "big") + good[4:]  # runs past the block
    assert refused("longer than the extensions", records(b"\x01" + len(bad).to_bytes(3, "big") + bad))
    assert refused("do not end where it does", raw_hello(good, tail=b"\x00\x00"))  # bytes after the block
    body = hello_body(good)[:-2]  # the block says 2 more bytes than the message has
    assert refused("do not end where it does", records(b"\x01" + len(body).to_bytes(3, "big") + body))
    assert refused("truncated", raw_hello(good + b"\x00\x00\x00"))  # 3 bytes: no room for a header
    assert first_name(raw_hello(None)) == ("none", None, None)  # no extensions at all
    assert first_name(raw_hello(ext(10, b"\x00\x02\x00\x1d"))) == ("none", None, None)


def test_a_truncated_client_hello_is_refused():
    for body in (b"\x03\x03" + bytes(20), b"\x03\x03" + bytes(32) + b"\x00\x00\x02", b"\x03\x03" + bytes(32) + b"\x00"):
        assert refused("truncated", records(b"\x01" + len(body).to_bytes(3, "big") + body)), body


def test_a_session_id_over_32_bytes_is_refused():
    assert first_name(raw_hello(sni_ext(b"a.test"), session_id=bytes(32))) == ("name", "a.test", None)
    assert refused("session id", raw_hello(sni_ext(b"a.test"), session_id=bytes(33)))


@pytest.mark.parametrize("etype", [0xFE0D, 0xFE08, 0xFE0C, 0xFF02, 0xFFCE, 0xFD00])
def test_an_encrypted_client_hello_is_refused(etype):
    """ECH (RFC 0xfe0d and its drafts) and ESNI: the client-facing server routes by the inner,
    encrypted name; the outer one we see is any name the guest likes."""
    assert refused("encrypted ClientHello", raw_hello(sni_ext(b"a.test") + ext(etype, b"\x00" * 8)))
    assert refused("encrypted ClientHello", raw_hello(ext(etype, b"\x00" * 8) + sni_ext(b"a.test")))


def test_a_record_header_is_judged_as_soon_as_it_is_complete():
    assert refused("length 0 or over 2^14", b"\x16\x03\x01\x00\x00")
    assert refused("length 0 or over 2^14", b"\x16\x03\x01\x40\x01")
    assert refused("not a ClientHello", b"\x16\x03\x01\x00\x04\x02\x00\x00\x10")  # a 4-byte ServerHello header


def test_what_follows_the_client_hello_is_not_read():
    hs = client_hello("a.test")[5:]
    assert first_name(records(hs + b"\x0b\x00\x00\x00")) == ("name", "a.test", None)  # in its record
    assert refused("truncated", records(b"\x01\x00\x00\x00") + b"\x15\x03\x03\x00\x02\x02\x28")  # an empty one


def test_a_client_hello_longer_than_64_kib_waits():
    """The 24-bit length is read whole (a ClientHello of 2^16 + n bytes is not one of n bytes)."""
    body = hello_body(sni_ext(b"a.test"))
    assert first_name(records(b"\x01" + (len(body) + 65536).to_bytes(3, "big") + body)) == ("more", None, None)


def test_lengths_over_32_kib_are_unsigned_and_over_64_kib_read_whole():
    big = ext(21, bytes(33000))  # padding (RFC 7685)
    assert first_name(raw_hello(big + sni_ext(b"a.test"))) == ("name", "a.test", None)
    assert first_name(raw_hello(sni_ext(b"a.test"), suites=bytes(33000))) == ("name", "a.test", None)
    assert first_name(raw_hello(big + sni_ext(b"a.test"), suites=bytes(33000))) == ("name", "a.test", None)


def test_cipher_suites_and_compression_methods_of_any_length_are_skipped():
    hello = raw_hello(sni_ext(b"a.test"), suites=b"\x13\x01\x13\x02\x13\x03", compression=b"\x00\x01")
    assert first_name(hello) == ("name", "a.test", None)


def test_a_host_name_of_256_bytes_or_more_is_read_whole_and_refused():
    assert refused("not a host name", raw_hello(sni_ext(b"a" * 63 + b"." + b"b" * 63 + b"." + b"c" * 63 + b"." +
                                                      b"d" * 63 + b"." + b"e" * 44)))  # 300 bytes


def test_neither_tls_nor_http_is_refused():
    for data in (b"\x00\x01", b"\x80\x2e\x01\x03\x01", b"ssh-2.0\r\n", b"\r\nGET / HTTP/1.1\r\n"):
        assert refused("neither a TLS", data), data


# --------------------------------------------------------------------------------------- HTTP


def test_host_names_the_server_with_its_port():
    assert host(b"Svc.Test:8080") == ("name", "svc.test", 8080)
    assert host(b"svc.test") == ("name", "svc.test", None)
    assert host(b"x") == ("name", "x", None)
    assert host(b"X.test") == ("name", "x.test", None) and host(b"a.tesX") == ("name", "a.tesx", None)
    assert host(b"[2001:DB8::1]:80") == ("name", "2001:db8::1", 80)
    assert host(b"[2001:db8::1]") == ("name", "2001:db8::1", None)
    assert host(b" \tsvc.test \t") == ("name", "svc.test", None)  # OWS around the value
    assert first_name(request(b"hOsT:svc.test")) == ("name", "svc.test", None)
    assert first_name(request(b"Host: svc.test", b"GET / HTTP/1.0")) == ("name", "svc.test", None)
    assert first_name(request(b"Accept: */*")) == ("none", None, None)
    assert first_name(b"GET / HTTP/1.1\r\n\r\n") == ("none", None, None)
    assert first_name(request(b"Host: svc.test", b"Get /?a=b HTTP/1.1")) == ("name", "svc.test", None)
    assert first_name(request(b"Host: svc.test\r\nX-A: caf\xc3\xa9")) == ("name", "svc.test", None)  # obs-text
    assert first_name(request(b"Host: svc.test", b"G / HTTP/1.1")) == ("name", "svc.test", None)  # a 1-letter method


def test_a_head_in_pieces_waits_for_its_end():
    data = request(b"Host: svc.test\r\nAccept: */*")
    for n in range(1, len(data)):
        assert first_name(data[:n]) == ("more", None, None), data[:n]
    assert first_name(data) == ("name", "svc.test", None)
    assert first_name(data + b"POST / HTTP/1.1\r\nHost: x\n") == ("name", "svc.test", None)  # the body is not read
    assert first_name(data + b"a body\r\n\r\n") == ("name", "svc.test", None)  # the head ends at the first


def test_the_issues_smuggled_head_is_refused():
    """http.server and nginx read ``Host: other.test`` (lines end at LF); a CRLF-only split read allowed.test."""
    assert refused("bare CR or LF", b"GET / HTTP/1.1\r\nX-Pad: 1\nHost: other.test\n\r\nHost: allowed.test\r\n\r\n")


@pytest.mark.parametrize("data", [
    b"GET / HTTP/1.1\nHost: other.test\r\n\r\n",  # in the request line
    b"GET / HTTP/1.1\r\nHost: allowed.test\rX-A: 1\r\n\r\n",  # a bare CR
    b"GET / HTTP/1.1\r\nHost: allowed.test\r\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: allowed.test\r\n\n",  # the head ends at LF LF for some
    b"GET / HTTP/1.1\r\nHost: other.test\n",  # not complete yet: refused at once, no wait
    b"GET / HTTP/1.1\r\nHost: other.test\r\r",
    b"GET / HT\n",
])
def test_a_bare_cr_or_lf_anywhere_in_the_head_is_refused(data):
    assert refused("bare CR or LF", data)


def test_a_last_cr_may_still_become_a_crlf():
    assert first_name(b"GET / HTTP/1.1\r") == ("more", None, None)
    assert first_name(b"GET / HTTP/1.1\r\nHost: a.test\r\n\r") == ("more", None, None)


@pytest.mark.parametrize("value", [b"allowed.test\x00", b"a\x01b", b"x\x7fy", b"allowed.test\x0b", b"\x0callowed.test"])
def test_a_control_character_in_a_field_value_is_refused(value):
    assert refused("control character in a field value", request(b"X-A: " + value + b"\r\nHost: allowed.test"))
    assert refused("control character in a field value", request(b"Host: " + value))


@pytest.mark.parametrize("line", [
    b" Host: other.test", b"\tHost: other.test",  # obs-fold (RFC 9112 5.2)
    b"Host : other.test", b"Host\t: other.test",  # whitespace before the colon (RFC 9112 5.1)
    b": other.test", b"Host other.test", b"Ho\x00st: other.test", b"Ho(st: other.test", b"H\xc3\xb6st: x",
])
def test_a_field_line_that_is_not_a_token_and_a_colon_is_refused(line):
    assert refused("not a token followed by a colon", request(b"X-A: 1\r\n" + line + b"\r\nHost: allowed.test"))


def test_two_host_fields_are_refused_whatever_their_case():
    assert refused("two Host", request(b"Host: allowed.test\r\nhost: other.test"))
    assert refused("two Host", request(b"Host: allowed.test\r\nHOST: allowed.test"))


@pytest.mark.parametrize("field", [b"X-Forwarded-Host", b"x-host", b"X-Original-Host", b"X-HTTP-Host-Override",
                                   b"Forwarded", b"X-Forwarded-Server"])
def test_host_override_fields_are_refused(field):
    assert why(request(b"Host: allowed.test\r\n" + field + b": other.test")) == \
        f"a {field.decode().lower()} field (some servers take the host from it instead of Host)"


@pytest.mark.parametrize("value", [
    b"u@allowed.test", b"other.test@allowed.test", b"allowed.test,other.test", b"allowed.test other.test",
    b"allowed%2etest", b"allowed.test.", b".allowed.test", b"allowed..test", b"", b"allowed.test:",
    b"allowed.test:0", b"allowed.test:65536", b"allowed.test:123456", b"allowed.test:000443", b"allowed.test:80:80", b"allowed.test:+80",
    b"allowed.test: 80", b"allowed.test:8O", b"[::1%25lo]", b"[::1", b"[zz::1]", b"[]", b"[::1]x", b"[::1]:",
    "allowed.t\u00e9st".encode(), b"a" * 64 + b".test", b"allowed.test/", b"allowed.test\\other.test",
])
def test_a_host_that_is_not_host_and_port_is_refused(value):
    assert refused("Host that is not host[:port]", request(b"Host: " + value))


def test_ports_at_the_edges():
    assert host(b"a.test:1") == ("name", "a.test", 1)
    assert host(b"a.test:65535") == ("name", "a.test", 65535)
    assert host(b"a.test:00443") == ("name", "a.test", 443)


@pytest.mark.parametrize("line", [
    b"GET / HTTP/1.2", b"GET / HTTP/2.0", b"PRI * HTTP/2.0", b"GET / HTTP/1.1 ", b"GET  / HTTP/1.1",
    b"GET\t/\tHTTP/1.1", b"GET /", b"G(ET / HTTP/1.1", b"GET / http/1.1", b"GET / HTTP/1.10",
])
def test_a_request_line_that_is_not_http1_is_refused(line):
    assert refused("not an HTTP/1 request line", request(b"Host: allowed.test", line))


def test_a_request_line_over_8_kib_is_refused_before_its_end():
    line = b"GET /" + b"a" * (MAX_REQUEST_LINE - 5)
    assert first_name(line[:-1]) == ("more", None, None)
    assert refused("over 8 KiB", line)


@pytest.mark.parametrize("target", [b"/\x01", b"/caf\xc3\xa9", b"/a\x7f"])
def test_a_control_or_non_ascii_byte_in_the_target_is_refused(target):
    assert refused("non-ASCII byte in the request target", request(b"Host: allowed.test", b"GET " + target + b" HTTP/1.1"))
    assert refused("non-ASCII byte in the request target", b"GET " + target + b" HTTP/1.1\r\nHost: al")  # before the head's end


@pytest.mark.parametrize("target", [b"*", b"allowed.test:80", b"allowed.test", b"ftp://allowed.test/", b"http", b"",
                                    b"http:/allowed.test/", b"http//allowed.test/", b"://allowed.test/"])
def test_a_target_neither_origin_nor_absolute_form_is_refused(target):
    """RFC 9112 3.2: asterisk-form (OPTIONS *) and authority-form outside CONNECT are refused too."""
    assert refused("neither origin-form nor absolute-form", request(b"Host: allowed.test", b"OPTIONS " + target +
                                                                  b" HTTP/1.1"))


@pytest.mark.parametrize("target", [b"//other.test/x", b"/\\other.test/x"])
def test_an_origin_form_target_that_looks_like_an_authority_is_refused(target):
    """``//other.test/x`` is a valid path, but urlsplit() and WHATWG URL parsers read other.test as its host."""
    assert refused("starting with //", request(b"Host: allowed.test", b"GET " + target + b" HTTP/1.1"))


def test_an_absolute_form_target_names_the_server_and_host_must_agree():
    """RFC 9112 3.2.2: a server takes the host from the target, ignoring Host; another reads Host."""
    def get(target: bytes, head: bytes = b"Host: allowed.test"):
        return first_name(request(head, b"GET " + target + b" HTTP/1.1"))

    assert get(b"http://allowed.test/x") == ("name", "allowed.test", 80)
    assert get(b"HTTPS://Allowed.Test") == ("name", "allowed.test", 443)
    assert get(b"http://allowed.test:8080/x", b"Host: allowed.test:8080") == ("name", "allowed.test", 8080)
    assert get(b"http://allowed.test:8080/x") == ("name", "allowed.test", 8080)  # Host without a port
    assert get(b"http://allowed.test?q=/x") == ("name", "allowed.test", 80)
    assert get(b"http://allowed.test#f/x") == ("name", "allowed.test", 80)
    for target in (b"http://allowed.test/a/b", b"http://allowed.test?a?b", b"http://allowed.test#a#b",
                   b"http://allowed.test/x://other.test/"):
        assert get(target) == ("name", "allowed.test", 80), target
    assert get(b"http://allowed.test/x", b"Host: allowed.test:80") == ("name", "allowed.test", 80)
    for target, head in ((b"http://other.test/x", b"Host: allowed.test"),
                         (b"http://allowed.test/x", b"Host: other.test"),
                         (b"http://allowed.test/x", b"Host: allowed.test:8080"),  # another port
                         (b"https://allowed.test/x", b"Host: allowed.test:80"),
                         (b"http://allowed.test/x", b"Accept: */*")):  # no Host
        assert refused("not the request target's host and port", request(head, b"GET " + target + b" HTTP/1.1"))
    for target in (b"http://u@allowed.test/", b"http://other.test@allowed.test/", b"http://allowed.test\\@other.test/",
                   b"http://allowed.test:/", b"http:///x", b"http://allowed.test%2f/"):
        assert refused("authority is not host[:port]", request(b"Host: allowed.test", b"GET " + target + b" HTTP/1.1"))


def test_connect_is_judged_by_its_target():
    """Issue 24 item 6: ``CONNECT other.test:443`` asks the server (a proxy) for other.test, whatever
    Host says: the target is the name, and a Host naming anything else is refused."""
    def connect(target: bytes, head: bytes = b""):
        return first_name(b"CONNECT " + target + b" HTTP/1.1\r\n" + head + b"\r\n")

    assert connect(b"other.test:443", b"Host: other.test:443\r\n") == ("name", "other.test", 443)
    assert connect(b"Other.Test:443", b"Host: other.test\r\n") == ("name", "other.test", 443)
    assert connect(b"[2001:db8::1]:22", b"Host: [2001:db8::1]:22\r\n") == ("name", "2001:db8::1", 22)
    for head in (b"Host: allowed.test\r\n", b"Host: allowed.test:443\r\n", b"Host: other.test:80\r\n", b""):
        assert refused("not the request target's host and port", b"CONNECT other.test:443 HTTP/1.1\r\n" + head +
                                                               b"\r\n"), head
    for target in (b"other.test", b"/x", b"http://other.test/", b"u@other.test:443", b"other.test:0"):
        assert refused("CONNECT target that is not host:port", b"CONNECT " + target + b" HTTP/1.1\r\nHost: " + target
                                                             + b"\r\n\r\n"), target


def post(head: bytes, body: bytes = b"", line: bytes = b"POST / HTTP/1.1") -> bytes:
    return line + b"\r\nHost: allowed.test\r\n" + head + b"\r\n\r\n" + body


@pytest.mark.parametrize("head", [
    b"Content-Length: 5\r\nContent-Length: 6", b"Content-Length: 5\r\nContent-Length: 5", b"Content-Length: 5, 5",
    b"Content-Length: +5", b"Content-Length: -1", b"Content-Length: 0x10", b"Content-Length: 1_0",
    b"Content-Length: 1 0", b"Content-Length:", b"Content-Length: 5.0", b"Content-Length: 9223372036854775808",
    b"Content-Length: 00000000000000000005", "Content-Length: \u0665".encode(),
])
def test_a_content_length_that_is_not_one_decimal_number_is_refused(head):
    """RFC 9112 6.3: two Content-Length or a list is an error; Python's int() would read +5, 1_0 and
    Arabic digits, a signed 64-bit reader 2^63 as negative."""
    assert refused("Content-Length that is not one decimal", post(head))


def test_a_content_length_names_the_content_and_may_be_up_to_2_63_minus_1():
    assert first_name(post(b"Content-Length: 9223372036854775807")) == ("name", "allowed.test", None)
    assert first_name(post(b"content-length:\t0005 ")) == ("name", "allowed.test", None)


@pytest.mark.parametrize("head", [
    b"Transfer-Encoding: gzip, chunked", b"Transfer-Encoding: chunked, chunked", b"Transfer-Encoding: gzip",
    b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked", b"Transfer-Encoding: identity",
    b"Transfer-Encoding: xchunked", b"Transfer-Encoding: chunked;q=1", b"Transfer-Encoding:",
])
def test_a_transfer_encoding_other_than_one_chunked_is_refused(head):
    assert refused("Transfer-Encoding other than one chunked", post(head))


def test_transfer_encoding_with_content_length_or_in_http_1_0_is_refused():
    """RFC 9112 6.1: TE and CL together is the request smuggling ambiguity (a server may take
    either); an HTTP/1.0 message with TE must be treated as faulty framing."""
    assert refused("with a Content-Length or in HTTP/1.0", post(b"Transfer-Encoding: chunked\r\nContent-Length: 5"))
    assert refused("with a Content-Length or in HTTP/1.0", post(b"Content-Length: 5\r\nTransfer-Encoding: chunked"))
    assert refused("with a Content-Length or in HTTP/1.0", post(b"Transfer-Encoding: chunked", line=b"POST / HTTP/1.0"))
    assert first_name(post(b"Transfer-Encoding: Chunked \t")) == ("name", "allowed.test", None)


@pytest.mark.parametrize("value", [b"h2c", b"websocket, h2c", b"h2c, websocket", b"HTTP/2.0", b"TLS/1.0", b"",
                                   b"websocket\r\nUpgrade: websocket"])
def test_an_upgrade_other_than_one_websocket_is_refused(value):
    """h2c: after a 101 the guest speaks HTTP/2, whose :authority names any host (RFC 9113 8.3.1)."""
    assert refused("Upgrade other than one websocket", request(b"Host: allowed.test\r\nUpgrade: " + value))


def test_content_on_a_connect_or_an_upgrade_is_refused():
    assert refused("content on a CONNECT", post(b"Upgrade: websocket\r\nContent-Length: 5", line=b"GET / HTTP/1.1"))
    assert refused("content on a CONNECT", post(b"Upgrade: websocket\r\nTransfer-Encoding: chunked"))
    assert refused("content on a CONNECT",
                   b"CONNECT a.test:443 HTTP/1.1\r\nHost: a.test:443\r\nContent-Length: 1\r\n\r\n")
    assert first_name(post(b"Upgrade: WebSocket\r\nContent-Length: 0")) == ("name", "allowed.test", None)


@pytest.mark.parametrize("field", [b"Content_Length", b"transfer_encoding", b"X_Forwarded_Host",
                                   b"x-forwarded_host"])
def test_a_framing_or_host_override_field_spelled_with_underscores_is_refused(field):
    """CGI and WSGI map ``-`` and ``_`` to one name (``HTTP_X_FORWARDED_HOST``)."""
    reason = why(post(field + b": 5"))
    assert reason.startswith(f"a {field.decode().lower()} field (some servers "), reason


# ------------------------------------------------------------------ every request of a connection


OK = request(b"Host: allowed.test")
OTHER = request(b"Host: other.test")


class Judge:
    """``judge(name, port)`` allowing ``allowed.test`` (any port) and ``allowed2.test:80``; remembers each call."""

    def __init__(self) -> None:
        self.calls: list = []

    def __call__(self, name: str, port) -> bool:
        self.calls.append((name, port))
        return name == "allowed.test" or (name, port) == ("allowed2.test", 80)


def feed(data: bytes, *cuts: int, answer: bytes | None = None):
    """``data`` fed to a :class:`Requests` in pieces cut at ``cuts`` (``answer``: the server's bytes,
    given once the stream waits for them): ``(bytes passed, refused, name, count)``."""
    r = Requests(Judge())
    out = b""
    start = 0
    for end in (*cuts, len(data)):
        out += r.feed(data[start:end])
        if answer is not None and r.waiting:
            out += r.answer(answer)
        start = end
    return out, r.refused, r.name, r.count


def stream_refused(part: str, data: bytes, *cuts: int) -> bool:
    """``data`` is refused for the one reason of :data:`REASONS` or :data:`STREAM_REASONS` containing ``part``."""
    (reason,) = [r for r in REASONS + STREAM_REASONS if part in r]
    out, refused_, name, _ = feed(data, *cuts)
    return refused_ == reason and name is None


def test_pipelined_and_kept_alive_requests_to_allowed_names_pass():
    data = OK + request(b"Host: Allowed.Test:8080") + request(b"Host: allowed2.test",
                                                               b"GET http://allowed2.test/ HTTP/1.1")
    assert feed(data) == (data, None, None, 3)
    assert feed(data, len(OK), len(OK) + 3) == (data, None, None, 3)
    r = Requests(Judge())
    assert r.feed(OK) == OK and r.feed(OK) == OK and r.count == 2


def test_a_later_request_naming_another_host_is_refused():
    """The hole of docs/security.md's "several requests": a second request on the connection, kept
    alive or pipelined, asked the shared address for other.test."""
    r = Requests(Judge())
    assert r.feed(OK) == OK
    assert r.feed(OTHER) == b"" and (r.refused, r.name, r.count) == ("name", "other.test", 1)
    assert r.feed(OK) == b""  # nothing more once refused
    assert feed(OK + OTHER) == (b"", "name", "other.test", 1)  # pipelined: the bytes before go neither
    assert feed(OK + request(b"Host: allowed2.test:8080")) == (b"", "name", "allowed2.test", 1)  # the port too
    assert feed(OK + request(b"Accept: */*")) == (b"", "none", None, 1)  # no Host


@pytest.mark.parametrize("later", [
    b"GET / HTTP/1.1\r\nX-Pad: 1\nHost: other.test\n\r\nHost: allowed.test\r\n\r\n",
    request(b"Host: allowed.test\r\nHost: other.test"),
    request(b"Host: allowed.test\r\nX-Forwarded-Host: other.test"),
    request(b"Host: allowed.test", b"GET http://other.test/ HTTP/1.1"),
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    b"\r\n" + OK,  # servers skip an empty line before a request line (RFC 9112 2.2): not we
    b"get / HTTP/1.1\r\nHost: allowed.test\r\n\r\n",
    request(b"Host: allowed.test\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA"),
    request(b"Host: allowed.test\r\nContent-Length: 1\r\nContent-Length: 2"),
])
def test_a_later_request_is_judged_as_the_first(later):
    """One function judges every head: what the first may not be, the second may not either."""
    out, refused_, name, count = feed(OK + later)
    assert (out, count) == (b"", 1) and refused_ not in ("name", "none", None)
    assert refused_ == first_name(later)[0] or later[:1] in b"\rg"  # (those two fail the first byte's test)


def test_a_body_holding_a_request_head_is_content_and_not_read():
    """Content-Length bytes are counted, not parsed: a head inside them is no request; the judge never sees it."""
    body = OTHER + b"x"
    data = post(b"Content-Length: %d" % len(body), body) + OK
    for cuts in ((), (len(data) - len(OK) - 3,), tuple(range(1, len(data)))):
        judge = Judge()
        r = Requests(judge)
        out, start = b"", 0
        for end in (*cuts, len(data)):
            out += r.feed(data[start:end])
            start = end
        assert (out, r.refused, r.count) == (data, None, 2)
        assert {name for name, _ in judge.calls} == {"allowed.test"}
    # a Content-Length shorter than what follows: the rest is the next request, and judged
    assert feed(post(b"Content-Length: 1", b"x" + OTHER)) == (b"", "name", "other.test", 1)
    assert feed(post(b"Content-Length: 0") + OTHER)[1:] == ("name", "other.test", 1)


def chunked(*chunks: bytes, last: bytes = b"0\r\n\r\n") -> bytes:
    return post(b"Transfer-Encoding: chunked") + b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + last


def test_a_chunked_body_holding_a_request_head_is_content_and_not_read():
    data = chunked(OTHER, b"a" * 300, b"\r\n\r\n" + OTHER) + OK
    assert feed(data) == (data, None, None, 2)
    assert feed(data, *range(1, len(data))) == (data, None, None, 2)
    data = (post(b"Transfer-Encoding: chunked") + b"0000000000000003\r\nabc\r\n00A\r\n" + b"b" * 10
            + b"\r\n0\r\n\r\n" + OK)
    assert feed(data) == (data, None, None, 2)  # 16 digits, leading zeros, upper-case hex
    assert feed(chunked(b"x") + OTHER)[1:] == ("name", "other.test", 1)  # the request after it is judged


@pytest.mark.parametrize("line", [
    b"5\n", b"5\r\r\n", b"5;ext=1\r\n", b"5;\r\n", b"5 \r\n", b" 5\r\n", b"\r\n", b"0x5\r\n", b"-5\r\n", b"+5\r\n",
    b"5\t\r\n", b"g\r\n", b"1" * 17 + b"\r\n", b"0" * 16 + b"5\r\n", b"5\rX\n", b"\n",
])
def test_a_chunk_size_line_that_is_not_hex_digits_and_crlf_is_refused(line):
    """RFC 9112 7.1: chunk-size is 1*HEXDIG; a bare LF (servers differ on it), a chunk extension
    (whose quoting servers parse differently, so refused outright), whitespace, a sign, a prefix,
    or more than 16 digits (Go refuses 17) are refused, at whatever byte the line is cut."""
    data = post(b"Transfer-Encoding: chunked") + line + b"hello\r\n0\r\n\r\n"
    assert stream_refused("chunk size that is not", data)
    assert stream_refused("chunk size that is not", data, *range(1, len(data)))
    bad = next((i for i in range(len(line)) if line[i:i + 1] not in b"0123456789abcdefABCDEF\r\n"), None)
    if bad is not None:  # refused at that byte, before the line's end
        assert stream_refused("chunk size that is not", post(b"Transfer-Encoding: chunked") + line[:bad + 1])


def test_a_chunk_size_over_2_63_minus_1_is_refused():
    head = post(b"Transfer-Encoding: chunked")
    assert stream_refused("chunk size over", head + b"8000000000000000\r\n")
    assert stream_refused("chunk size over", head + b"ffffffffffffffff\r\n")
    assert feed(head + b"7fffffffffffffff\r\nabc") == (head + b"7fffffffffffffff\r\nabc", None, None, 1)
    for cut in (16, 17):  # 16 digits, and the CR, wait for the rest of their line
        assert feed(head + b"7fffffffffffffff\r\nabc", len(head) + cut) == (head + b"7fffffffffffffff\r\nabc",
                                                                         None, None, 1)


def test_chunk_data_must_end_with_crlf_and_trailer_fields_are_refused():
    head = post(b"Transfer-Encoding: chunked")
    assert stream_refused("chunk data not followed by CRLF", head + b"5\r\nhelloX\r\n0\r\n\r\n")
    assert stream_refused("chunk data not followed by CRLF", head + b"5\r\nhello\n0\r\n\r\n")
    assert stream_refused("chunk data not followed by CRLF", head + b"5\r\nhello\r\r\n")
    assert stream_refused("last chunk not followed by CRLF", head + b"0\r\nHost: other.test\r\n\r\n")
    assert stream_refused("last chunk not followed by CRLF", head + b"0\r\n\n")
    assert stream_refused("last chunk not followed by CRLF", head + b"0\r\n\r" + OTHER)
    assert stream_refused("last chunk not followed by CRLF", head + b"0\r\n\r" + OTHER, len(head) + 5)


def test_a_later_head_over_16_kib_is_refused_and_one_of_16_kib_passes():
    pad = b"X-Pad: " + b"a" * (MAX_HELD - len(OK) - 9)
    full = request(b"Host: allowed.test\r\n" + pad)
    assert len(full) == MAX_HELD and feed(OK + full) == (OK + full, None, None, 2)
    assert feed(OK + full, len(OK) + 100) == (OK + full, None, None, 2)
    over = request(b"Host: allowed.test\r\n" + pad + b"a")
    assert stream_refused("head over 16 KiB", OK + over)
    assert stream_refused("head over 16 KiB", OK + over, len(OK) + 100)
    assert stream_refused("head over 16 KiB", OK + over[:MAX_HELD] + b"a" * 1000)  # refused before its end
    r = Requests(Judge())
    assert r.feed(OK + over[:MAX_HELD]) == OK and r.refused is None  # 16 KiB, not complete: it waits
    assert r.feed(b"a") == b"" and r.refused == "a request head over 16 KiB"


def test_a_later_connect_or_upgrade_is_refused():
    """Its answer would come after the answers to the requests before it, which are not framed here."""
    for later in (b"CONNECT allowed.test:443 HTTP/1.1\r\nHost: allowed.test:443\r\n\r\n",
                  request(b"Host: allowed.test\r\nUpgrade: websocket\r\nConnection: Upgrade")):
        assert stream_refused("CONNECT or Upgrade after the first", OK + later)


CONNECT = b"CONNECT allowed.test:443 HTTP/1.1\r\nHost: allowed.test:443\r\n\r\n"
WEBSOCKET = request(b"Host: allowed.test\r\nUpgrade: websocket\r\nConnection: Upgrade")


def test_a_connect_is_a_tunnel_once_the_server_answers_2xx():
    """RFC 9110 9.3.6: the guest's bytes after the CONNECT wait for the answer; after a 2xx they are
    the tunnel's, unread (a TLS ClientHello to the CONNECT's target, or anything)."""
    r = Requests(Judge())
    assert r.feed(CONNECT + b"\x16\x03\x01") == CONNECT and r.waiting
    assert r.feed(OTHER) == b"" and r.waiting
    assert r.answer(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 Connection est") == b"" and r.waiting
    assert r.answer(b"ablished\r\n\r\n") == b"\x16\x03\x01" + OTHER and not r.waiting
    assert r.feed(OTHER) == OTHER and r.answer(b"HTTP/1.1 400 x\r\n\r\n") == b"" and r.refused is None
    for status in (b"HTTP/1.0 200 OK", b"HTTP/1.1 204", b"HTTP/1.1 299 x"):
        assert feed(CONNECT + OTHER, answer=status + b"\r\n\r\n") == (CONNECT + OTHER, None, None, 1), status


def test_a_websocket_upgrade_is_a_tunnel_once_the_server_answers_101():
    r = Requests(Judge())
    assert r.feed(WEBSOCKET + b"\x81\x05hello") == WEBSOCKET and r.waiting
    assert r.answer(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n\x81\x02hi") == b"\x81\x05hello"
    assert r.feed(OTHER) == OTHER and r.refused is None


@pytest.mark.parametrize("first, status", [
    (CONNECT, b"HTTP/1.1 407 Proxy Authentication Required"), (CONNECT, b"HTTP/1.1 101 Switching Protocols"),
    (CONNECT, b"HTTP/1.1 300 x"), (CONNECT, b"HTTP/1.1 199 x\r\n\r\nHTTP/1.1 403 Forbidden"),
    (WEBSOCKET, b"HTTP/1.1 200 OK"), (WEBSOCKET, b"HTTP/1.1 426 Upgrade Required"), (WEBSOCKET, b"OK"),
    (WEBSOCKET, b"HTTP/1.1 1010 x"), (WEBSOCKET, b"HTTP/2 101"), (WEBSOCKET, b"HTTP/1.1 10x"),
    (WEBSOCKET, b"HTTP/1.1\t101 x"), (CONNECT, b"HTTP/1.1  200 x"), (CONNECT, b"\r\n\r\nHTTP/1.1 200 OK"),
])
def test_an_answer_that_does_not_switch_leaves_http_and_the_held_bytes_are_judged(first, status):
    """After any other answer the server reads the guest's next bytes as requests: so are they judged."""
    assert feed(first + OTHER, answer=status + b"\r\n\r\n") == (first, "name", "other.test", 1)
    assert feed(first + OK, answer=status + b"\r\nContent-Length: 0\r\n\r\n") == (first + OK, None, None, 2)


def test_an_answer_without_a_head_end_in_16_kib_does_not_switch():
    r = Requests(Judge())
    assert r.feed(WEBSOCKET + OTHER) == WEBSOCKET
    assert r.answer(b"HTTP/1.1 101 x\r\n" + b"a" * (MAX_HELD - 16)) == b"" and r.waiting
    assert r.answer(b"a") == b"" and (r.refused, r.name) == ("name", "other.test")


def test_at_most_16_kib_wait_for_the_answer():
    r = Requests(Judge())
    assert r.feed(CONNECT + b"a" * MAX_HELD) == CONNECT and r.refused is None
    assert r.feed(b"a") == b"" and r.refused == "over 16 KiB sent before the server answered a CONNECT or Upgrade"
    assert r.answer(b"HTTP/1.1 200 OK\r\n\r\n") == b""


def test_an_answer_while_not_waiting_is_ignored():
    r = Requests(Judge())
    assert r.answer(b"HTTP/1.1 200 OK\r\n\r\n") == b"" and r.feed(OTHER) == b"" and r.name == "other.test"


def test_a_name_once_allowed_on_a_connection_is_not_judged_again():
    """As an open flow is not when its DNS binding expires; another port is judged."""
    judge = Judge()
    r = Requests(judge)
    r.feed(OK + OK + request(b"Host: allowed.test:8080") + OK)
    assert judge.calls == [("allowed.test", None), ("allowed.test", 8080)] and r.count == 4


def test_at_most_16_names_are_remembered():
    judge = Judge()
    r = Requests(judge)
    heads = [request(b"Host: allowed.test:%d" % p) for p in range(1, 18)]
    r.feed(b"".join(heads) + heads[0] + heads[15] + heads[16])
    assert len(judge.calls) == 18 and judge.calls[-1] == ("allowed.test", 17) and r.count == 20


def test_content_is_counted_in_constant_memory():
    """A 256 MiB body, as Content-Length or as chunks of 1 MiB, fed in 64 KiB pieces: each piece is
    passed as it is (no copy), and memory does not grow."""
    piece = b"a" * 65536
    size = 256 << 20
    for head, frame in ((post(b"Content-Length: %d" % size), None),
                        (post(b"Transfer-Encoding: chunked"), b"100000\r\n")):
        r = Requests(Judge())
        assert r.feed(head) == head
        tracemalloc.start()
        try:
            for i in range(size // len(piece)):
                if frame is not None and i % 16 == 0:
                    assert r.feed((b"\r\n" if i else b"") + frame) == (b"\r\n" if i else b"") + frame
                assert r.feed(piece) is piece
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 4096, peak
        assert r.feed(b"\r\n0\r\n\r\n" if frame else b"") is not None and r.feed(OK) == OK and r.count == 2


#: Streams of several requests, each fed whole, cut once at every byte and byte by byte below.
STREAMS = [
    OK + post(b"Content-Length: 40", OTHER + b"1234") + chunked(OTHER, b"x" * 17) + OK,
    OK + post(b"Content-Length: 3", b"abc") + OTHER,
    chunked(b"abc", last=b"0\r\nX: 1\r\n\r\n") + OK,
    OK + b"GET / HTTP/1.1\r\nX-Pad: 1\nHost: other.test\n\r\nHost: allowed.test\r\n\r\n",
    post(b"Transfer-Encoding: chunked") + b"3;x\r\nabc\r\n0\r\n\r\n",
    post(b"Transfer-Encoding: chunked") + b"0" * 16 + b"5\r\nhello\r\n0\r\n\r\n",  # 17 digits
    OK + post(b"Transfer-Encoding: chunked\r\nContent-Length: 4") + b"0\r\n\r\n",
    OK + OK[:-2] + b"\n",
]


@pytest.mark.parametrize("data", STREAMS)
def test_a_stream_cut_at_any_byte_gets_the_same_verdict(data):
    whole = feed(data)
    for cut in range(1, len(data)):
        out, *verdict = feed(data, cut)
        assert verdict == list(whole[1:]), cut
        assert out == data if whole[1] is None else data.startswith(out) and len(out) <= cut, cut
    out, *verdict = feed(data, *range(1, len(data)))
    assert verdict == list(whole[1:])
    if whole[1] is None:
        assert out == data


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(STREAMS), st.lists(st.integers(min_value=1, max_value=400), max_size=12))
def test_a_stream_cut_anywhere_gets_the_same_verdict(data, cuts):
    whole = feed(data)
    out, *verdict = feed(data, *sorted({c for c in cuts if c < len(data)}))
    assert verdict == list(whole[1:])
    assert out == data if whole[1] is None else data.startswith(out)


# ------------------------------------------------------------------------------ the verifier


class Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data

    async def read(self, n: int) -> bytes:
        chunk, self.data = self.data[:n], self.data[n:]
        return chunk


class Writer:
    def __init__(self) -> None:
        self.aborted = self.closed = False
        self.written = b""
        self.transport = self

    def abort(self) -> None:
        self.aborted = True

    def write(self, data: bytes) -> None:
        self.written += data

    async def drain(self) -> None:
        pass

    def can_write_eof(self) -> bool:
        return False

    def close(self) -> None:
        self.closed = True


class FakeFlow:
    """What the verifier reads of a flow: to 192.0.2.10:``port``, allowed as allowed.test."""

    def __init__(self, port: int) -> None:
        self.remote, self.destination, self.name = "192.0.2.10", ("192.0.2.10", port), "allowed.test"
        self.guest = ("10.0.2.15", 4000)
        self.upstream: Writer | None = None

    async def open_upstream(self):
        self.upstream = Writer()
        return Reader(b""), self.upstream


def verifier(*allow: str, onward=None) -> SniVerifier:
    """A verifier under ``--egress-default deny --allow ALLOW...`` with allowed.test and other.test
    both bound to 192.0.2.10 (a CDN address)."""
    eg = Egress(NetworkConfig(egress_default="deny", egress_allow=list(allow)).validate(), {})
    now = asyncio.get_running_loop().time()
    for name in ("allowed.test", "other.test"):
        eg.bindings.bind("192.0.2.10", name, now + 60)
    return SniVerifier(eg, {"egress.sni_denied": 0, "egress.sni_verified": 0, "egress.sni_requests_verified": 0},
                       onward, timeout=1.0)


async def verify(v: SniVerifier, data: bytes, port: int = 443) -> str:
    """``"passed"`` (the held bytes went upstream) or ``"reset"``."""
    flow, guest = FakeFlow(port), Writer()
    await v(flow, Reader(data), guest)
    if flow.upstream is not None:
        assert not guest.aborted and flow.upstream.written == data
        return "passed"
    assert guest.aborted
    return "reset"


async def test_the_verifier_passes_an_allowed_name_and_resets_the_rest():
    v = verifier("allowed.test:443")
    assert await verify(v, client_hello("allowed.test")) == "passed"
    assert await verify(v, client_hello("other.test")) == "reset"  # bound, not allowed
    assert await verify(v, client_hello("third.test")) == "reset"  # allowed by no rule, not bound
    assert await verify(v, client_hello("allowed.test"), port=8443) == "reset"  # the flow's port is not allowed
    assert await verify(v, request(b"Host: allowed.test")) == "passed"
    assert await verify(v, b"GET / HTTP/1.1\r\nX-Pad: 1\nHost: other.test\n\r\nHost: allowed.test\r\n\r\n") == "reset"
    assert v.counters == {"egress.sni_verified": 2, "egress.sni_denied": 4, "egress.sni_requests_verified": 0}


async def test_the_port_a_request_names_must_be_allowed_too():
    """A proxy at allowed.test:443 asked for allowed.test:22 would open port 22, which no rule allows."""
    v = verifier("allowed.test:443")
    assert await verify(v, request(b"Host: allowed.test:443")) == "passed"
    assert await verify(v, request(b"Host: allowed.test:22")) == "reset"
    assert await verify(v, request(b"Host: allowed.test", b"GET http://allowed.test/ HTTP/1.1")) == "reset"  # :80
    assert await verify(v, request(b"Host: allowed.test", b"GET https://allowed.test/ HTTP/1.1")) == "passed"
    v = verifier("allowed.test")  # every port
    assert await verify(v, request(b"Host: allowed.test:22")) == "passed"


async def test_the_verifier_judges_connect_by_its_target():
    """Issue 24 item 6, through the verifier: CONNECT other.test:443 with ``Host: allowed.test`` is reset
    (it was let through as allowed.test); CONNECT allowed.test:443 to allowed.test's own address passes;
    a tunnel to a port no rule allows is reset."""
    v = verifier("allowed.test:443")
    assert await verify(v, b"CONNECT other.test:443 HTTP/1.1\r\nHost: allowed.test\r\n\r\n") == "reset"
    assert await verify(v, b"CONNECT other.test:443 HTTP/1.1\r\nHost: other.test:443\r\n\r\n") == "reset"
    assert await verify(v, b"CONNECT allowed.test:443 HTTP/1.1\r\nHost: allowed.test:443\r\n\r\n") == "passed"
    assert await verify(v, b"CONNECT allowed.test:22 HTTP/1.1\r\nHost: allowed.test:22\r\n\r\n") == "reset"


async def test_too_long_timeout_and_eof_are_reset_and_nothing_is_closed_cleanly():
    v = verifier("allowed.test:443")
    assert await verify(v, b"GET / HTTP/1.1\r\nX-A: " + b"a" * MAX_HELD) == "reset"  # no end within MAX_HELD
    assert await verify(v, b"GET / HTTP/1.1\r\n") == "reset"  # EOF before the head's end
    flow, guest = FakeFlow(443), Writer()
    await v(flow, Reader(b""), guest)
    assert guest.closed and not guest.aborted and flow.upstream is None
    assert v.counters["egress.sni_denied"] == 2


async def test_rules_naming_tcp_decide_the_verdict():
    v = verifier("allowed.test:443/tcp")
    assert await verify(v, client_hello("allowed.test")) == "passed"
    v = verifier("allowed.test:443/udp")
    assert await verify(v, client_hello("allowed.test")) == "reset"


class Chunks(Reader):
    """Gives at most ``sizes[i]`` bytes in read ``i`` (the last size for the rest); then waits for ever
    when ``hang``, else EOF."""

    def __init__(self, data: bytes, *sizes: int, hang: bool = False) -> None:
        super().__init__(data)
        self.sizes, self.hang = list(sizes), hang

    async def read(self, n: int) -> bytes:
        if not self.data and self.hang:
            await asyncio.Event().wait()
        size = self.sizes.pop(0) if len(self.sizes) > 1 else self.sizes[0]
        return await super().read(min(n, size))


async def test_bytes_arriving_in_pieces_are_held_together():
    v = verifier("allowed.test:443")
    flow, guest = FakeFlow(443), Writer()
    hello = client_hello("allowed.test")
    await v(flow, Chunks(hello, 7), guest)
    assert flow.upstream is not None and flow.upstream.written == hello


@pytest.mark.parametrize("first", [MAX_HELD, 100])
async def test_at_most_max_held_bytes_are_read_without_a_name(first):
    v = verifier("allowed.test:443")
    reader = Chunks(b"GET / HTTP/1.1\r\nX-A: " + b"a" * MAX_HELD, first, MAX_HELD * 2)
    flow, guest = FakeFlow(443), Writer()
    await v(flow, reader, guest)
    assert guest.aborted and len(reader.data) == 21  # what is past MAX_HELD stays unread


async def test_a_guest_that_names_nothing_in_time_is_reset_at_the_timeout(caplog):
    v = verifier("allowed.test:443")
    v.timeout = 0.05
    flow, guest = FakeFlow(443), Writer()
    loop = asyncio.get_running_loop()
    start = loop.time()
    with caplog.at_level("INFO", logger="aioslirp.limits"):
        await asyncio.wait_for(v(flow, Chunks(b"GET / HTTP/1.1\r\n", 4, hang=True), guest), 5)
    assert guest.aborted and flow.upstream is None and loop.time() - start < 0.5
    assert [r.getMessage() for r in caplog.records] == [
        "verify-sni: guest flow to 192.0.2.10:443 (allowed as allowed.test) refused: timeout: reset"]


def test_the_default_timeout_is_10_s():
    assert SniVerifier(None, {}).timeout == 10.0


async def test_a_verified_flow_goes_through_the_onward_handlers_connect():
    class Onward:
        flows: list = []

        async def connect(self, flow):
            self.flows.append(flow)
            flow.upstream = Writer()
            return Reader(b""), flow.upstream

    onward = Onward()
    v = verifier("allowed.test:443", onward=onward)
    flow, guest = FakeFlow(443), Writer()
    flow.open_upstream = None  # not to be used
    await v(flow, Reader(client_hello("allowed.test")), guest)
    assert onward.flows == [flow] and first_name(flow.upstream.written) == ("name", "allowed.test", None)


async def test_each_reset_is_logged_once_per_address_and_name_with_its_reason(caplog):
    v = verifier("allowed.test:443")
    prefix = "verify-sni: guest flow to 192.0.2.10:443 (allowed as allowed.test) "
    with caplog.at_level("INFO", logger="aioslirp.limits"):
        for data in (client_hello("other.test"), client_hello("other.test"), client_hello("third.test"),
                     client_hello(None), request(b"Host: a\r\nHost: a")):
            await verify(v, data)
        await verify(v, b"GET / HTTP/1.1\r\n")
    assert [r.getMessage() for r in caplog.records] == [
        prefix + "names 'other.test', not allowed for it: reset",
        prefix + "names 'third.test', not allowed for it: reset",
        prefix + "names no server: reset",
    ]
    # the refusals share the key (address, None) with "no server": logged once in all
    v = verifier("allowed.test:443")
    caplog.clear()
    with caplog.at_level("INFO", logger="aioslirp.limits"):
        await verify(v, request(b"Host: a\r\nHost: a"))
        await verify(v, b"GET / HTTP/1.1\r\nX-A: " + b"a" * MAX_HELD)
    assert [r.getMessage() for r in caplog.records] == [prefix + "refused: two Host fields (RFC 9112 3.2): reset"]
    for data, why_ in ((b"GET / HTTP/1.1\r\nX-A: " + b"a" * MAX_HELD, "too long"), (b"GET / HTTP/1.1\r\n", "eof")):
        v = verifier("allowed.test:443")
        caplog.clear()
        with caplog.at_level("INFO", logger="aioslirp.limits"):
            await verify(v, data)
        assert [r.getMessage() for r in caplog.records] == [prefix + f"refused: {why_}: reset"]


async def test_the_log_keeps_at_most_1024_addresses_and_names(caplog):
    v = verifier("allowed.test:443")
    with caplog.at_level("INFO", logger="aioslirp.limits"):
        for i in range(1030):
            await verify(v, raw_hello(sni_ext(b"n%d.test" % i)))
    assert len(caplog.records) == 1024 and v.counters["egress.sni_denied"] == 1030


async def test_each_reset_is_audited():
    class Audit:
        records: list = []

        def record(self, rec: dict) -> None:
            self.records.append(rec)

    v = verifier("allowed.test:443")
    v.egress.ctx = types.SimpleNamespace(audit=Audit())
    await verify(v, client_hello("other.test"))
    await verify(v, client_hello("allowed.test"))
    await verify(v, request(b"Host: a\r\nHost: a"))
    flow = FakeFlow(443)
    flow.guest = ("fd00::15", 4001)
    await v(flow, Reader(client_hello("other.test")), Writer())
    recs = Audit.records
    assert [r.pop("time") > 0 for r in recs] == [True, True, True]
    assert recs == [{"event": "deny", "proto": "tcp", "guest": guest, "dst": "192.0.2.10", "port": 443,
                     "name": name, "verdict": "deny", "rule": "verify-sni"}
                    for guest, name in (("10.0.2.15:4000", "other.test"), ("10.0.2.15:4000", None),
                                        ("[fd00::15]:4001", "other.test"))]


# ------------------------------------------------------------- the verifier, request after request


class Later(Reader):
    """Gives ``data`` in one read after ``delay`` seconds, then EOF ``delay`` seconds later."""

    def __init__(self, data: bytes, delay: float = 0.02) -> None:
        super().__init__(data)
        self.delay = delay

    async def read(self, n: int) -> bytes:
        await asyncio.sleep(self.delay)
        return await super().read(n)


class SlowEnd(Chunks):
    """:class:`Chunks`, whose EOF comes 50 ms after the last bytes (the server's answer comes first)."""

    async def read(self, n: int) -> bytes:
        if not self.data:
            await asyncio.sleep(0.05)
        return await super().read(n)


class Upstream(Writer):
    """The server's side: its writer records what reached it (a write after its FIN fails, as a
    transport's does); its reader answers ``answer`` then EOF."""

    def __init__(self, answer: bytes = b"", delay: float = 0.0) -> None:
        super().__init__()
        self.reader = Later(answer, delay) if delay else Reader(answer)
        self.eof = False

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof = True

    def write(self, data: bytes) -> None:
        assert not self.eof, "write after write_eof"
        super().write(data)


def http_flow(answer: bytes = b"", delay: float = 0.0) -> FakeFlow:
    flow = FakeFlow(80)

    async def open_upstream():
        flow.upstream = Upstream(answer, delay)
        return flow.upstream.reader, flow.upstream

    flow.open_upstream = open_upstream
    return flow


async def test_the_verifier_resets_a_kept_alive_request_to_another_host(caplog):
    """The request after the first, in a later read, names other.test: it never reaches the server,
    both sides are reset, counted, logged and audited."""
    class Audit:
        records: list = []

        def record(self, rec: dict) -> None:
            self.records.append(rec)

    v = verifier("allowed.test:80")
    v.egress.ctx = types.SimpleNamespace(audit=Audit())
    flow, guest = http_flow(), Writer()
    with caplog.at_level("INFO", logger="aioslirp.limits"):
        await v(flow, Chunks(OK + OK + OTHER + OK, len(OK)), guest)
    assert flow.upstream.written == OK + OK and guest.aborted and flow.upstream.aborted
    assert v.counters == {"egress.sni_verified": 1, "egress.sni_denied": 1, "egress.sni_requests_verified": 1}
    assert [r.getMessage() for r in caplog.records] == [
        "verify-sni: guest flow to 192.0.2.10:80 (allowed as allowed.test) after 2 requests, names 'other.test', "
        "not allowed for it: reset"]
    assert [(r["name"], r["rule"]) for r in Audit.records] == [("other.test", "verify-sni")]


async def test_the_verifier_resets_a_pipelined_request_to_another_host_before_any_connect(caplog):
    v = verifier("allowed.test:80")
    flow, guest = http_flow(), Writer()
    with caplog.at_level("INFO", logger="aioslirp.limits"):
        await v(flow, Reader(OK + post(b"Content-Length: 1", b"x") + OTHER), guest)
    assert flow.upstream is None and guest.aborted
    assert v.counters == {"egress.sni_verified": 0, "egress.sni_denied": 1, "egress.sni_requests_verified": 0}
    assert [r.getMessage() for r in caplog.records] == [
        "verify-sni: guest flow to 192.0.2.10:80 (allowed as allowed.test) after 2 requests, names 'other.test', "
        "not allowed for it: reset"]
    caplog.clear()
    with caplog.at_level("INFO", logger="aioslirp.limits"):
        await v(http_flow(), Reader(chunked(b"a") + b"\r\n" + OK), Writer())  # an empty line before a request
    assert [r.getMessage() for r in caplog.records] == [
        "verify-sni: guest flow to 192.0.2.10:80 (allowed as allowed.test) after 1 request, refused: not an HTTP/1 "
        "request line (RFC 9112 3): reset"]


async def test_the_verifier_passes_requests_and_content_to_allowed_names():
    v = verifier("allowed.test:80")
    data = OK + post(b"Content-Length: %d" % len(OTHER), OTHER) + chunked(OTHER, b"b" * 1000) + OK
    flow, guest = http_flow(), Writer()
    await v(flow, Chunks(data, len(OK) + 7, 5, 100), guest)
    assert flow.upstream.written == data and not guest.aborted and not flow.upstream.aborted
    assert v.counters == {"egress.sni_verified": 1, "egress.sni_denied": 0, "egress.sni_requests_verified": 3}
    await v(http_flow(), Reader(OK + OK), Writer())
    assert v.counters == {"egress.sni_verified": 2, "egress.sni_denied": 0, "egress.sni_requests_verified": 4}


async def test_the_verifier_tunnels_after_a_2xx_to_a_connect_and_judges_after_another_answer():
    v = verifier("allowed.test:443")
    flow, guest = http_flow(b"HTTP/1.1 200 Connection established\r\n\r\n"), Writer()
    flow.destination = ("192.0.2.10", 443)
    hello = client_hello("other.test")
    await v(flow, SlowEnd(CONNECT + hello + OTHER, len(CONNECT)), guest)
    assert flow.upstream.written == CONNECT + hello + OTHER and flow.upstream.eof and not guest.aborted
    assert guest.written == b"HTTP/1.1 200 Connection established\r\n\r\n"
    flow, guest = http_flow(b"HTTP/1.1 407 Proxy Authentication Required\r\nContent-Length: 0\r\n\r\n"), Writer()
    flow.destination = ("192.0.2.10", 443)
    await v(flow, SlowEnd(CONNECT + OTHER, len(CONNECT)), guest)
    assert flow.upstream.written == CONNECT and guest.aborted and flow.upstream.aborted
    assert v.counters["egress.sni_denied"] == 1


async def test_a_guest_that_ends_before_the_answer_to_its_connect_drops_what_waited_for_it():
    """Its FIN goes to the server at once; the held bytes could only follow it: they are dropped."""
    v = verifier("allowed.test:443")
    flow, guest = http_flow(b"HTTP/1.1 200 Connection established\r\n\r\n", delay=0.02), Writer()
    flow.destination = ("192.0.2.10", 443)
    await v(flow, Reader(CONNECT + OTHER), guest)
    assert flow.upstream.written == CONNECT and flow.upstream.eof and not guest.aborted
    assert guest.written == b"HTTP/1.1 200 Connection established\r\n\r\n"
    r = Requests(Judge())
    assert r.feed(CONNECT + OTHER) == CONNECT and r.waiting
    r.end()
    assert not r.waiting and r.answer(b"HTTP/1.1 200 OK\r\n\r\n") == b"" and r.refused is None
    assert r.feed(OK) == OK  # (nothing more comes after the guest's FIN; were it to, it is a request)
    r = Requests(Judge())
    r.feed(OK)
    r.end()
    assert r.feed(OK) == OK  # not waiting: nothing to drop
