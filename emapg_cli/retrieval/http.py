"""Client for a Search-R1-compatible retrieval server (`POST /retrieve`), e.g. an e5/FAISS wiki-18 server.

Request `{"queries": [str], "topk": int, "return_scores": true}`, response
`{"result": [[{"document": {"contents", ...}, "score": float}, ...] per query]}` (Search-R1
`search_r1/search/retrieval_server.py`). One request per agent turn carries every active episode's
query, each distinct query once (the n samples of a prompt often search the same words; the hits are fanned back
out), split into requests of at most `BATCH_QUERIES` queries and `max_request_chars` characters; a query
longer than `max_query_chars` (4,096, the server's `Limits`) is cut to it, as a policy can write a long one and the
server refuses longer ones: cutting keeps a training run going where refusing would stop it. `search.url` may list
several servers: requests are dealt round-robin over them (in parallel, one thread per URL). Each request has a
deadline (`search.timeout_s`) that covers all of it, from connecting to the reply's last byte
(emapg_cli/http_client.py); a failed request (connection refused, timeout, HTTP 5xx or 429) goes to the next
URL at once, and when every URL failed it is retried in the next round, after an exponential back-off; a round
resends only the requests that failed. When every round fails the run stops with a one-line UserError
(checkpoints are written atomically, so the last one stays intact). Standard library only.

Replies are read defensively: at most `MAX_REPLY_BYTES`, UTF-8, JSON (not nested past Python's
recursion limit), of Search-R1's shape (one list of hits per query, each with a `document` whose
`contents` is a string and an optional finite numeric `score`); anything else is one UserError line naming
the URL and what was wrong. Only http(s) URLs are opened, and redirects are not followed.
"""

from __future__ import annotations

import itertools
import json
import math
import time
import urllib.parse
from http.client import HTTPException
from typing import Optional

from emapg_cli import http_client
from emapg_cli.errors import UserError
from emapg_cli.retrieval.base import Hit, hit_from_doc
from emapg_cli.retrieval.server import Limits


#: Most queries sent in one request: a larger batch (a turn of many episodes, a whole evaluation set) is split into
#: requests of this many, in order, so it stays under a server's query limit (`retriever serve --max-queries`,
#: 4,096 by default) and its time under the timeout; each query's hits do not depend on the others in its request.
#: 256 (it was 1,024): bm25 over 10^6 passages takes ~50 ms of CPU per query, so 1,024 queries took minutes.
BATCH_QUERIES = 256
#: Seconds per request (`search.timeout_s`): the whole of it, from connecting to the reply's last byte (a server
#: dripping its reply is abandoned at this deadline and the request goes to the next URL). 120 s (it was 30): a
#: request of BATCH_QUERIES queries to bm25 over 10^6 passages takes ~14 s of CPU (21-37 s measured on a shared
#: 2-core machine), and another trainer's request may be ahead of it in the server's queue.
TIMEOUT_S = 120.0
#: Largest reply read (bytes); a longer one is an error, not a memory spike.
MAX_REPLY_BYTES = 256 << 20
_EXPECTED = '{"result": [[{"document": {"contents": ...}, "score": ...}, ...] per query]}'


def check_url(url: str) -> str:
    """`url` when it is an http(s) URL with a host; ValueError (one line) otherwise."""
    parsed = urllib.parse.urlsplit(url) if isinstance(url, str) else None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError("must be an http:// or https:// URL with a host (a Search-R1 /retrieve endpoint, e.g. "
                         "http://127.0.0.1:8000/retrieve)")
    return url


class _BadReply(Exception):
    """The server answered, but not with what was asked for (retrying cannot help)."""


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
        raise _BadReply(f"the reply is not JSON ({http_client.one_line(e, 80)})") from None


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
    """`queries` in order, in requests of at most BATCH_QUERIES queries and `Limits.max_request_chars` characters in
    all (each query is at most `Limits.max_query_chars`, fewer), so each fits a server's default limits."""
    batches: list[list[str]] = []
    chars = 0
    for q in queries:
        if not batches or len(batches[-1]) == BATCH_QUERIES or chars + len(q) > Limits.max_request_chars:
            batches.append([])
            chars = 0
        batches[-1].append(q)
        chars += len(q)
    return batches


class _Failed(Exception):
    """One try of one request failed in a way another try (or another server) can fix: the connection, a timeout,
    HTTP 5xx or 429."""


class HTTPRetriever:
    """`Retriever` speaking Search-R1's `/retrieve` JSON over HTTP to one server or several (round-robin)."""

    def __init__(self, url: str | list[str], timeout_s: float = TIMEOUT_S, retries: int = 3, backoff_s: float = 1.0,
                 max_reply_bytes: int = MAX_REPLY_BYTES):
        """`url`: one /retrieve URL or a list (requests are dealt round-robin; a failed one goes to the next URL).
        `retries`: extra rounds after the first; the wait before round i (1-based) is backoff_s * 2**(i - 1)."""
        urls = [url] if isinstance(url, str) else list(url)
        if not urls:
            raise UserError("search.url is an empty list; give at least one /retrieve URL")
        for u in urls:
            try:
                check_url(u)
            except ValueError as e:
                raise UserError(f"search.url {e}, got {u!r:.100}") from None
        self.urls, self.timeout_s, self.retries, self.backoff_s = urls, timeout_s, retries, backoff_s
        self.url = urls[0]
        self.max_reply_bytes = max_reply_bytes
        self._turn = itertools.count()  # round-robin: the first URL of each request in turn

    def _post(self, payload: dict, url: str):
        """One try of one request, all of it within `timeout_s`; `_Failed` when retrying can help, UserError when it
        cannot."""
        try:
            reply = http_client.request(url, "POST", json.dumps(payload).encode(), timeout_s=self.timeout_s,
                                        max_reply_bytes=self.max_reply_bytes,
                                        headers={"Content-Type": "application/json"})
        except http_client.Deadline:
            raise _Failed(f"the request took over {self.timeout_s:g} s (search.timeout_s)") from None
        except http_client.ReplyTooLarge as e:
            raise UserError(f"retriever {url}: {e}; expected {_EXPECTED}") from None
        except (OSError, HTTPException, ValueError) as e:  # refused, reset, a status line that is not HTTP
            raise _Failed(http_client.one_line(e) or type(e).__name__) from None
        if reply.status != 200:
            said = http_client.server_error(reply.body)
            said = f"HTTP {reply.status} {http_client.one_line(reply.reason, 60)}" + (f": {said}" if said else "")
            if reply.status < 500 and reply.status != 429:  # the server understood and refused: retrying cannot help
                raise UserError(f"retriever {url} failed: {said}")
            raise _Failed(said)
        try:
            return _decode(reply.body)
        except _BadReply as e:
            raise UserError(f"retriever {url}: {e}; expected {_EXPECTED}") from None

    def _ask(self, batch: list[str], topk: int, first: int) -> tuple[Optional[list[list[Hit]]], str, str]:
        """(hits, "", "") from the first URL that answers, trying each once from urls[first]; else (None, url, why)."""
        last = ("", "")
        for i in range(len(self.urls)):
            url = self.urls[(first + i) % len(self.urls)]
            try:
                reply = self._post({"queries": batch, "topk": topk, "return_scores": True}, url)
            except _Failed as e:
                last = (url, str(e))
                continue
            try:
                return _hits(reply, len(batch), topk), "", ""
            except _BadReply as e:
                raise UserError(f"retriever {url}: unexpected reply ({e}); expected {_EXPECTED}") from None
        return None, *last

    def search(self, queries: list[str], topk: int) -> list[list[Hit]]:
        """Hits per query, each query cut to `Limits.max_query_chars` characters; identical queries are sent once.

        The distinct queries go in `_batches`, dealt round-robin over `search.url` (several URLs: requests in
        parallel, one thread per URL); a failed request (connection, timeout, 5xx, 429) goes to the next URL at
        once, and once every URL failed it waits for the next round (back-off doubling), which resends only the
        requests that failed. A refusal (other 4xx) or a reply without Search-R1's shape is a UserError (one line).
        """
        cut = [q[:Limits.max_query_chars] for q in queries]
        distinct = list(dict.fromkeys(cut))
        batches = _batches(distinct)
        pending = dict(enumerate(batches))
        done: dict[int, list[list[Hit]]] = {}
        first = {b: next(self._turn) for b in pending}
        why = ("", "")
        for round_ in range(self.retries + 1):
            if round_:
                time.sleep(self.backoff_s * 2 ** (round_ - 1))
            asks = {b: (pending[b], topk, first[b] + round_) for b in pending}
            for b, (hits, url, said) in self._ask_all(asks).items():
                if hits is None:
                    why = (url, said)
                else:
                    done[b] = hits
                    del pending[b]
            if not pending:
                break
        if pending:
            missing = sum(map(len, pending.values()))
            raise UserError(f"retriever {why[0]} failed after {(round_ + 1) * len(self.urls)} tries"
                            f"{f' ({missing} of {len(distinct)} queries unanswered)' if len(distinct) > missing else ''}: "
                            f"{why[1]}")
        by_query = {q: row for b, batch in enumerate(batches) for q, row in zip(batch, done[b])}
        return [list(by_query[q]) for q in cut]  # a list per query: duplicates share no mutable row

    def _ask_all(self, asks: dict) -> dict:
        """`_ask` for each batch: in this thread for one URL or one batch, else one thread per URL."""
        if len(self.urls) == 1 or len(asks) == 1:
            return {b: self._ask(*a) for b, a in asks.items()}
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=len(self.urls), thread_name_prefix="emapg-retriever-client") as pool:
            futures = {b: pool.submit(self._ask, *a) for b, a in asks.items()}
            return {b: f.result() for b, f in futures.items()}

    def close(self) -> None:
        """Nothing held between requests."""
