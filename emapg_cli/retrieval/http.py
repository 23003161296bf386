"""Client for a Search-R1-compatible retrieval server (`POST /retrieve`), e.g. an e5/FAISS wiki-18 server.

Request `{"queries": [str], "topk": int, "return_scores": true}`, response
`{"result": [[{"document": {"contents", ...}, "score": float}, ...] per query]}` (Search-R1
`search_r1/search/retrieval_server.py`). One request per agent turn carries every active episode's
query (split into requests of at most `BATCH_QUERIES` queries and `MAX_REQUEST_CHARS` characters; a query
longer than `MAX_QUERY_CHARS` (4,096) is cut to it, as a policy can write a long one and the server
refuses longer ones: cutting keeps a training run going where refusing would stop it). Each request has a timeout; a failed request (connection refused, timeout, HTTP 5xx) is
retried with exponential back-off; when every try fails the run stops with a one-line UserError
(checkpoints are written atomically, so the last one stays intact). Standard library only.

Replies are read defensively: at most `MAX_REPLY_BYTES`, UTF-8, JSON (not nested past Python's
recursion limit), of Search-R1's shape (one list of hits per query, each with a `document` whose
`contents` is a string and an optional finite numeric `score`), whole within `REPLY_DEADLINE_FACTOR`
times the timeout; anything else is one UserError line naming
the URL and what was wrong. Only http(s) URLs are opened, and redirects are not followed.
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.parse
import urllib.request

from emapg_cli.errors import UserError
from emapg_cli.retrieval.base import Hit, hit_from_doc
from emapg_cli.retrieval.server import MAX_QUERY_CHARS, MAX_REQUEST_CHARS


#: Most queries sent in one request: a larger batch (a whole evaluation set in one turn) is split into
#: requests of this many, in order, so it stays under a server's query limit (`retriever serve
#: --max-queries`, 4,096 by default); each query's hits do not depend on the others in its request.
BATCH_QUERIES = 1024
#: Largest reply read (bytes); a longer one is an error, not a memory spike.
MAX_REPLY_BYTES = 256 << 20
#: A reply must arrive whole within this many times the request's timeout (`search.timeout_s`): the timeout
#: bounds each read of the socket, this the whole reply, so a server sending one byte just under the timeout
#: cannot hold a run for hours.
REPLY_DEADLINE_FACTOR = 3
_EXPECTED = '{"result": [[{"document": {"contents": ...}, "score": ...}, ...] per query]}'


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is reported as the HTTP error it is, never followed (it could point anywhere)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


def check_url(url: str) -> str:
    """`url` when it is an http(s) URL with a host; ValueError (one line) otherwise."""
    parsed = urllib.parse.urlsplit(url) if isinstance(url, str) else None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError("must be an http:// or https:// URL with a host (a Search-R1 /retrieve endpoint, e.g. "
                         "http://127.0.0.1:8000/retrieve)")
    return url


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + "..."


class _BadReply(Exception):
    """The server answered, but not with what was asked for (retrying cannot help)."""


def _read_capped(response, limit: int, deadline_s: float) -> bytes:
    """The reply's body: at most `limit` bytes (else `_BadReply`), read in chunks within `deadline_s` seconds in all
    (else TimeoutError: a server that is slow, retried like one that is down)."""
    chunks, got, end = [], 0, time.monotonic() + deadline_s
    while True:
        chunk = response.read1(min(65536, limit + 1 - got))  # at most one read of the socket
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        got += len(chunk)
        if got > limit:
            raise _BadReply(f"the reply is over {limit} bytes")
        if time.monotonic() > end:
            raise TimeoutError(f"the reply took over {deadline_s:g} s ({got} bytes so far)")


def _decode(data: bytes):
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _BadReply(f"the reply is not UTF-8 (byte {e.start})") from None
    try:
        return json.loads(text)
    except RecursionError:
        raise _BadReply("the reply's JSON is nested too deeply") from None
    except ValueError as e:
        raise _BadReply(f"the reply is not JSON ({_one_line(e, 80)})") from None


def _hits(reply, n_queries: int, topk: int) -> list[list[Hit]]:
    """Search-R1's reply as hits, each checked; `_BadReply` naming the first thing of another shape."""
    if not isinstance(reply, dict) or not isinstance(reply.get("result"), list):
        raise _BadReply("no \"result\" list")
    result = reply["result"]
    if len(result) != n_queries:
        raise _BadReply(f"{len(result)} result lists for {n_queries} queries")
    rows = []
    for q, hits in enumerate(result):
        if not isinstance(hits, list):
            raise _BadReply(f"result {q} is not a list")
        row = []
        for h in hits[:topk]:
            doc = h.get("document") if isinstance(h, dict) else None
            if not isinstance(doc, dict) or not isinstance(doc.get("contents"), str):
                raise _BadReply(f"result {q}: a hit without a document.contents string")
            score = h.get("score", 0.0)
            try:  # an integer of 400 digits is a JSON number too, but no float (OverflowError)
                finite = not isinstance(score, bool) and isinstance(score, (int, float)) and math.isfinite(float(score))
            except OverflowError:
                finite = False
            if not finite:
                raise _BadReply(f"result {q}: a score that is not a finite number")
            if not isinstance(doc.get("id", ""), (str, int)) or isinstance(doc.get("id"), bool):
                raise _BadReply(f"result {q}: a document id that is not a string")
            row.append(hit_from_doc(doc, score))
        rows.append(row)
    return rows


def _batches(queries: list[str]) -> list[list[str]]:
    """`queries` in order, in requests of at most BATCH_QUERIES queries and MAX_REQUEST_CHARS characters in all
    (each query is at most MAX_QUERY_CHARS <= MAX_REQUEST_CHARS), so each fits a server's default limits."""
    batches: list[list[str]] = []
    chars = 0
    for q in queries:
        if not batches or len(batches[-1]) == BATCH_QUERIES or chars + len(q) > MAX_REQUEST_CHARS:
            batches.append([])
            chars = 0
        batches[-1].append(q)
        chars += len(q)
    return batches


class HTTPRetriever:
    """`Retriever` speaking Search-R1's `/retrieve` JSON over HTTP."""

    def __init__(self, url: str, timeout_s: float = 30.0, retries: int = 3, backoff_s: float = 1.0,
                 max_reply_bytes: int = MAX_REPLY_BYTES):
        """`retries`: extra tries after the first; the wait before try i (1-based) is backoff_s * 2**(i - 1)."""
        try:
            check_url(url)
        except ValueError as e:
            raise UserError(f"search.url {e}, got {url!r:.100}") from None
        self.url, self.timeout_s, self.retries, self.backoff_s = url, timeout_s, retries, backoff_s
        self.max_reply_bytes = max_reply_bytes
        self._opener = urllib.request.build_opener(_NoRedirect)

    def _post(self, payload: dict):
        data = json.dumps(payload).encode()
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            request = urllib.request.Request(self.url, data=data, headers={"Content-Type": "application/json"}, method="POST")
            try:
                with self._opener.open(request, timeout=self.timeout_s) as response:
                    return _decode(_read_capped(response, self.max_reply_bytes,
                                                self.timeout_s * REPLY_DEADLINE_FACTOR))
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code} {_one_line(e.reason, 60)}{self._server_says(e)}"
                if e.code < 500:  # the server understood and refused: retrying cannot help
                    break
            except _BadReply as e:
                raise UserError(f"retriever {self.url}: {e}; expected {_EXPECTED}") from None
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError, ValueError) as e:
                # ValueError: http.client's own, e.g. a status line it cannot parse
                last = _one_line(getattr(e, "reason", e) or type(e).__name__)
        raise UserError(f"retriever {self.url} failed after {attempt + 1} tries: {last}")

    @staticmethod
    def _server_says(e: urllib.error.HTTPError) -> str:
        """`: <the {"error"} of the reply>` when it has one (read at most 4 KiB), else nothing."""
        try:
            said = json.loads(e.read(4096).decode("utf-8"))["error"]
            return f": {_one_line(said)}" if isinstance(said, str) else ""
        except Exception:  # any other body: the status alone says enough
            return ""

    def search(self, queries: list[str], topk: int) -> list[list[Hit]]:
        """Hits per query, each query cut to MAX_QUERY_CHARS characters, sent in `_batches`; a reply that does not
        have Search-R1's shape is a UserError (one line)."""
        hits: list[list[Hit]] = []
        for batch in _batches([q[:MAX_QUERY_CHARS] for q in queries]):
            reply = self._post({"queries": batch, "topk": topk, "return_scores": True})
            try:
                hits += _hits(reply, len(batch), topk)
            except _BadReply as e:
                raise UserError(f"retriever {self.url}: unexpected reply ({e}); expected {_EXPECTED}") from None
        return hits

    def close(self) -> None:
        """Nothing held between requests."""
