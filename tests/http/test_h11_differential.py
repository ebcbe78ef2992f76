"""The gateway server's request framing against h11's: thousands of generated connections (pipelined requests,
each with its head and a body by ``Content-Length`` or chunked, cut into reads anywhere), read by both. Each
request must come out of both the same (method, target, fields, body), or both must refuse it.

Where RFC 9110/9112 let a recipient either refuse or accept, the two may differ, and only there: each such
mutation below names which side may refuse alone and the RFC's words for it (:data:`MAY_REFUSE`). A request
refused by one side and read by the other without such a mutation fails the test, as does any request both read
but frame differently.

The server is driven through its protocol object with an in-memory transport (no sockets): the same code that
reads a socket, run a thousand times a second.
"""

from __future__ import annotations

import asyncio
import string
from dataclasses import dataclass, field
from typing import Any

import h11
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgate.http.limits import MAX_HEAD_BYTES
from kvgate.http.server import Conn, HttpServer, Request, Response

EXAMPLES = 2000

MAY_REFUSE: dict[str, tuple[str, str]] = {
    "version_2": ("kvgate", "RFC 9110 §15.6.6: 505 for a major version the server does not serve (h11 reads 2.0)"),
    "dup_content_length": ("kvgate", "RFC 9110 §8.6: a recipient MAY reject duplicated Content-Length values"),
    "content_length_list": ("kvgate", "RFC 9110 §8.6: the same, as one list"),
    "content_length_and_te": ("kvgate", "RFC 9112 §6.3: a server MAY reject Content-Length with Transfer-Encoding"),
    "te_in_http10": ("kvgate", "RFC 9112 §6.1: Transfer-Encoding in HTTP/1.0 MUST be treated as faulty framing"),
    "host_list": ("kvgate", "RFC 9112 §3.2: a Host that is not one host[:port] is invalid, MUST be 400"),
    "obs_fold": ("kvgate", "RFC 9112 §5.2: a server MUST either reject obs-fold with 400 or unfold it"),
    "bare_lf": ("kvgate", "RFC 9112 §2.2: a recipient MAY recognize a bare LF as a line terminator"),
    "unknown_method": ("kvgate", "RFC 9110 §9.1: a method the server does not implement is refused"),
    "ctl_in_value": ("kvgate", "RFC 9110 §5.5: field values with CTLs are invalid (h11 retains them: MAY)"),
    "space_after_chunk_size": ("kvgate", "RFC 9112 §7.1: chunk-size is followed by chunk-ext or CRLF, no space"),
    "leading_empty_line": ("h11", "RFC 9112 §2.2: a server SHOULD ignore at least one empty line before a request"),
    "double_space": ("h11", "RFC 9112 §3: recipients MAY parse the request line on whitespace boundaries"),
}
"""Mutations after which one side may refuse a request the other reads: the side, and why the RFCs allow it."""

BOTH_REFUSE = ("no_host", "two_hosts", "te_not_chunked", "te_chunked_twice", "http09", "space_before_colon",
               "bad_chunk_size", "chunk_without_crlf", "nul_in_value", "cl_not_a_number", "dup_cl_differ")
"""Mutations both must refuse."""

READ_ALIKE = ("te_case", "trailing_ows", "chunk_ext", "trailers", "leading_zeros", "obs_text", "expect",
              "upgrade", "http_1_2", "empty_value")
"""Mutations both must read the same."""

TOKEN = string.ascii_letters + string.digits + "!#$%&'*+-.^_`|~"
VCHAR = "".join(chr(c) for c in range(0x21, 0x7F))
PCHAR = string.ascii_letters + string.digits + "-._~!$&'()*+,;=:@%/"


@dataclass
class Spec:
    """One generated request: its head's parts, its body and how it is framed, and what was done to it."""

    method: str
    target: str
    version: str
    fields: list[tuple[str, str]]
    body: bytes
    framing: str  # "none", "length", "chunked"
    chunks: list[int]
    mutation: str | None
    closes: bool = False  # the connection ends after it (Connection: close, HTTP/1.0, an upgrade)
    eol: str = "\r\n"
    prefix: bytes = b""
    extra_line_space: bool = False
    fold: bool = False
    trailers: list[tuple[str, str]] = field(default_factory=list)
    size_style: str = "plain"  # "plain", "upper", "zeros", "ext", "space", "bad"
    chunk_crlf: bool = True


def render(s: Spec) -> bytes:
    eol = s.eol.encode()
    sp = b"  " if s.extra_line_space else b" "
    line = s.method.encode() + sp + s.target.encode("latin-1")
    line += (b" HTTP/" + s.version.encode()) if s.version != "0.9" else b""
    out = [s.prefix + line + eol]
    for name, value in s.fields:
        out.append(name.encode("latin-1") + b":" + value.encode("latin-1") + eol)
        if s.fold and name == "X-Fold":
            out.append(b" continued" + eol)
    out.append(eol)
    if s.framing == "chunked":
        pos = 0
        for n in [*s.chunks, 0]:
            data = s.body[pos:pos + n]
            pos += n
            size = b"%x" % n
            if s.size_style == "upper":
                size = size.upper()
            elif s.size_style == "zeros":
                size = b"00" + size
            elif s.size_style == "ext":
                size += b';name="v";q=1'
            elif s.size_style == "space":
                size += b" "
            elif s.size_style == "bad" and n:
                size = b"g" + size
            out.append(size + b"\r\n")
            if n:
                out.append(data + (b"\r\n" if s.chunk_crlf else b""))
        out.extend(f"{k}: {v}\r\n".encode("latin-1") for k, v in s.trailers)
        out.append(b"\r\n")
    else:
        out.append(s.body)
    return b"".join(out)


MUTATIONS = [*READ_ALIKE, *BOTH_REFUSE, *MAY_REFUSE]
"""(Hypothesis draws the first ones most: the mutations both read alike.)"""


FRAMING_LOOKALIKES = st.lists(st.sampled_from([b"\r\n", b"\r\n\r\n", b"0\r\n\r\n", b"5\r\nhello\r\n", b"x",
                                               b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n", b"\n", b"\r"]),
                               max_size=40).map(b"".join)
"""Bodies made of what framing is made of (blank lines, chunk ends, whole requests): the server cuts reads at
blank lines while it looks for a chunked body's end."""


@st.composite
def specs(draw: st.DrawFn, last: bool) -> Spec:
    framing = draw(st.sampled_from(["none", "length", "chunked"]))
    body = b"" if framing == "none" else draw(st.binary(max_size=300) | FRAMING_LOOKALIKES)
    chunks: list[int] = []
    if framing == "chunked":
        rest = len(body)
        while rest:
            n = draw(st.integers(1, rest))
            chunks.append(n)
            rest -= n
    method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]))
    target = "/" + draw(st.text(PCHAR, max_size=40))
    if draw(st.booleans()):
        target += "?" + draw(st.text(PCHAR + "?", max_size=30))
    fields = [("Host", draw(st.sampled_from(["x", "127.0.0.1:8000", "localhost", "[::1]:80", "a.example"])))]
    for _ in range(draw(st.integers(0, 4))):
        name = draw(st.text(TOKEN, min_size=1, max_size=12))
        if name.lower() in ("host", "content-length", "transfer-encoding", "connection", "upgrade", "expect"):
            continue
        value = draw(st.text(VCHAR + " \t", max_size=30)).strip(" \t")
        fields.append((name, " " + value if draw(st.booleans()) else value))
    if framing == "length":
        fields.append(("Content-Length", str(len(body))))
    elif framing == "chunked":
        fields.append(("Transfer-Encoding", "chunked"))
    fields = draw(st.permutations(fields))
    spec = Spec(method, target, "1.1", list(fields), body, framing, chunks,
                draw(st.sampled_from(MUTATIONS)) if draw(st.integers(0, 9)) < 6 else None)
    mutate(spec, draw)
    if last and draw(st.integers(0, 9)) == 0:
        spec.fields.append(("Connection", "close"))
    spec.closes = spec.closes or any(k == "Connection" and v == "close" for k, v in spec.fields)
    return spec


def _set(spec: Spec, name: str, value: str | None) -> None:
    spec.fields = [(k, v) for k, v in spec.fields if k.lower() != name.lower()]
    if value is not None:
        spec.fields.append((name, value))


def mutate(s: Spec, draw: st.DrawFn) -> None:  # noqa: C901  (one case a mutation)
    m = s.mutation
    n = len(s.body)
    if m == "version_2":
        s.version = draw(st.sampled_from(["2.0", "3.0"]))
    elif m == "http_1_2":
        s.version = "1.2"
    elif m == "http09":
        s.version, s.fields, s.body, s.framing = "0.9", [], b"", "none"
    elif m == "te_in_http10":
        s.version, s.framing = "1.0", "chunked"
        s.chunks = [n] if n else []
        _set(s, "Content-Length", None)
        _set(s, "Transfer-Encoding", "chunked")
    elif m in ("dup_content_length", "content_length_list", "cl_not_a_number", "dup_cl_differ"):
        s.framing, s.chunks = "length", []
        _set(s, "Transfer-Encoding", None)
        _set(s, "Content-Length", {"dup_content_length": str(n), "content_length_list": f"{n}, {n}",
                                   "cl_not_a_number": f"+{n}", "dup_cl_differ": str(n)}[m])
        if m in ("dup_content_length", "dup_cl_differ"):
            s.fields.append(("Content-Length", str(n) if m == "dup_content_length" else str(n + 1)))
    elif m == "content_length_and_te":
        s.framing, s.chunks = "chunked", [n] if n else []
        _set(s, "Transfer-Encoding", "chunked")
        s.fields.append(("Content-Length", str(n)))
    elif m in ("te_not_chunked", "te_chunked_twice", "te_case"):
        s.framing, s.chunks = "chunked", [n] if n else []
        _set(s, "Content-Length", None)
        _set(s, "Transfer-Encoding", {"te_not_chunked": draw(st.sampled_from(["gzip, chunked", "gzip", "identity"])),
                                      "te_chunked_twice": "chunked, chunked", "te_case": "Chunked"}[m])
    elif m == "no_host":
        _set(s, "Host", None)
    elif m == "two_hosts":
        s.fields.append(("Host", draw(st.sampled_from(["x", "other"]))))
    elif m == "host_list":
        _set(s, "Host", "a, b")
    elif m == "obs_fold":
        s.fields.append(("X-Fold", "start"))
        s.fold = True
    elif m == "bare_lf":
        s.eol = "\n"
        s.framing = "none" if s.framing == "chunked" else s.framing
        if s.framing == "none":
            _set(s, "Transfer-Encoding", None)
            s.body = b""
    elif m == "unknown_method":
        s.method = draw(st.sampled_from(["FOO", "BREW", "get", "X-THING"]))
    elif m in ("ctl_in_value", "nul_in_value", "obs_text", "trailing_ows", "empty_value", "expect", "upgrade"):
        value = {"ctl_in_value": "a\x01b", "nul_in_value": "a\x00b", "obs_text": "caf\xe9 \xff",
                 "trailing_ows": "spaced \t ", "empty_value": "", "expect": "100-continue",
                 "upgrade": "websocket"}[m]
        name = {"expect": "Expect", "upgrade": "Upgrade"}.get(m, "X-Value")
        s.fields.append((name, value))
        if m == "upgrade":
            s.fields.append(("Connection", "Upgrade"))
            s.closes = True
    elif m == "space_before_colon":
        s.fields.append(("X-Bad ", "v"))
    elif m in ("chunk_ext", "leading_zeros", "space_after_chunk_size", "bad_chunk_size", "chunk_without_crlf",
               "trailers"):
        if s.framing != "chunked":
            s.framing, s.chunks = "chunked", [n] if n else []
            _set(s, "Content-Length", None)
            _set(s, "Transfer-Encoding", "chunked")
        if not s.body and m in ("bad_chunk_size", "chunk_without_crlf"):
            s.body, s.chunks = b"abc", [3]
        s.size_style = {"chunk_ext": "ext", "leading_zeros": "zeros", "space_after_chunk_size": "space",
                        "bad_chunk_size": "bad"}.get(m, "upper" if draw(st.booleans()) else "plain")
        s.chunk_crlf = m != "chunk_without_crlf"
        if m == "trailers":
            s.trailers = [("X-Trailer", "t"), ("X-Sum", "1")]
    elif m == "leading_empty_line":
        s.prefix = b"\r\n"
    elif m == "double_space":
        s.extra_line_space = True
    if s.version in ("1.0", "0.9"):
        s.closes = True
        if s.version == "0.9":
            s.fields = []


# -- the two readers -------------------------------------------------------------------------------------------

Framed = tuple[str, str, list[tuple[str, str]], bytes]
"""(method, target, fields with lower-case names, body)."""
REFUSED = "refused"


class Transport:
    """An in-memory transport: what the server writes, and whether it closed."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.closed = False
        self.paused = False

    def write(self, data: bytes) -> None:
        self.out += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 1) if name == "peername" else default


def normalize(fields: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Field names lower-cased (the values as read; h11 writes Transfer-Encoding's lower-cased)."""
    return [(k.lower(), v.lower() if k.lower() == "transfer-encoding" else v) for k, v in fields]


async def kvgate_reads(server: HttpServer, pieces: list[bytes]) -> list[Framed | str]:
    seen: list[Framed | str] = []

    async def handler(req: Request) -> Response:
        seen.append((req.method, req.raw_path, normalize(list(req.headers.items())), req.body))
        return Response(body=b"")

    server.handler = handler
    transport = Transport()
    conn = Conn(server)
    conn.connection_made(transport)
    for p in pieces:
        if transport.closed or transport.paused:
            break
        conn.data_received(p)
        for _ in range(3):
            await asyncio.sleep(0)
    for _ in range(200):
        if conn.task is None:
            break
        await asyncio.sleep(0)
    assert conn.task is None, "the server did not finish its responses"
    if conn.rejected:
        seen.append(REFUSED)
    conn.connection_lost(None)
    return seen


def h11_reads(pieces: list[bytes]) -> list[Framed | str]:
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
    seen: list[Framed | str] = []
    current: list[Any] = []
    try:
        for p in pieces:
            conn.receive_data(p)
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA or event is h11.PAUSED:
                    break
                if isinstance(event, h11.Request):
                    fields = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in event.headers.raw_items()]
                    current = [event.method.decode(), event.target.decode("latin-1"), normalize(fields), b""]
                elif isinstance(event, h11.Data):
                    current[3] += bytes(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    seen.append(tuple(current))  # type: ignore[arg-type]
                    conn.send(h11.Response(status_code=200, headers=[("Content-Length", "0")]))
                    conn.send(h11.EndOfMessage())
                    if conn.our_state is h11.MUST_CLOSE or conn.their_state is not h11.DONE:
                        return seen
                    conn.start_next_cycle()
    except h11.RemoteProtocolError:
        seen.append(REFUSED)
    return seen


@dataclass
class Tally:
    """What the examples covered (the test must not pass by generating nothing either side reads)."""

    read_alike: int = 0
    both_refused: int = 0
    may_refuse: dict[str, int] = field(default_factory=dict)
    mutations: set[str] = field(default_factory=set)


def compare(reqs: list[Spec], ours: list[Framed | str], theirs: list[Framed | str], tally: Tally) -> None:
    for i, spec in enumerate(reqs):
        a = ours[i] if i < len(ours) else None
        b = theirs[i] if i < len(theirs) else None
        if spec.mutation:
            tally.mutations.add(spec.mutation)
        if a == b:
            if a is None:
                return  # (neither read it whole: its bytes ran out)
            if a == REFUSED:
                tally.both_refused += 1
                assert spec.mutation not in READ_ALIKE, (spec.mutation, render(spec))
                return
            tally.read_alike += 1
            assert spec.mutation not in BOTH_REFUSE, (spec.mutation, render(spec))
            if spec.closes:
                return
            continue
        side = "kvgate" if a == REFUSED else "h11" if b == REFUSED else None
        allowed = MAY_REFUSE.get(spec.mutation or "")
        assert side is not None and allowed is not None and allowed[0] == side, (
            f"request {i} ({spec.mutation}) framed differently:\n  kvgate: {a!r}\n  h11:    {b!r}\n"
            f"  wire: {render(spec)!r}")
        tally.may_refuse[spec.mutation or ""] = tally.may_refuse.get(spec.mutation or "", 0) + 1
        return


def test_request_framing_matches_h11() -> None:
    tally = Tally()
    loop = asyncio.new_event_loop()

    async def make() -> HttpServer:
        return HttpServer(lambda req: None)  # type: ignore[arg-type,return-value]  (each example sets its own)

    server = loop.run_until_complete(make())

    @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(data=st.data(), count=st.integers(1, 4))
    def check(data: st.DataObject, count: int) -> None:
        reqs = [data.draw(specs(last=i == count - 1)) for i in range(count)]
        wire = b"".join(render(s) for s in reqs)
        cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, len(wire) - 1)), max_size=6))))
        pieces = [wire[a:b] for a, b in zip([0, *cuts], [*cuts, len(wire)], strict=True) if wire[a:b]]
        ours = loop.run_until_complete(kvgate_reads(server, pieces))
        theirs = h11_reads(pieces)
        compare(reqs, ours, theirs, tally)

    try:
        check()
    finally:
        loop.close()
    assert tally.read_alike > EXAMPLES // 2, tally
    assert tally.both_refused > EXAMPLES // 10, tally
    missing = set(MUTATIONS) - tally.mutations
    assert not missing, f"mutations never generated: {missing}"
