"""`emapg retriever serve`: Search-R1's `/retrieve` API over a saved index, so one index can back several trainers.

Built on the standard library's `http.server` with one thread per connection (no web framework, nothing
added to emapg's dependencies). A connection's thread reads and checks its request; the searching is done
by a bounded pool of `workers` threads (`_Batcher`) that take the queued queries of every waiting request
(same topk) together, up to `max_batch` queries, into ONE `retriever.search` call: bm25s and FAISS score a
batch in one call, and a turn of 256 episodes is one request. At most `max_pending` queries wait (more:
429, retried by emapg's client). Identical queries of a request are searched once, and the encoded reply
of recent (query, topk) pairs is kept in an LRU cache of `cache_mb` MiB (`_ReplyCache`).

  POST /retrieve  {"queries": [str], "topk": int | null, "return_scores": bool}
    -> {"result": [[{"document": {"id", "title", "contents"}, "score": float}, ...], ...]}
       (with return_scores false: a plain list of documents per query, as Search-R1's server)
  GET  /health    -> {"status": "ok", "rows": N}

Every resource a client can claim is bounded (`Limits`: body, queries and their characters, topk, hits, reply size,
pending queries, connections and their time; docs/reliability.md "The retriever server's limits" has each bound and
its refusal). Every refusal is a 4xx/503 with a JSON body `{"error": "..."}`; a retriever that raises is a 500 with
the exception's class, and the server keeps serving.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from emapg_cli.serve.http_server import BoundedHandler, BoundedServer, Refused
from emapg_cli.retrieval.base import Retriever


@dataclass(frozen=True)
class Limits:
    """The server's bounds (the options of `emapg retriever serve`, whose defaults these are)."""

    #: Largest request body accepted (bytes); `Content-Length` above it is refused (413) without reading.
    max_body_bytes: int = 16 << 20
    #: Most queries in one request (a training turn sends one per active episode).
    max_queries: int = 4096
    #: Longest query (characters); a longer one is refused (413) before any search. The search's time grows with
    #: the query's tokens (each walks its word's postings), and it cannot be interrupted: this bounds it per query.
    max_query_chars: int = 4096
    #: Most characters of all the queries of one request together (413 above it): with max_query_chars this bounds
    #: the tokens one request can make the search walk (at most about half of them: a word and a space each).
    max_request_chars: int = 1 << 20
    #: Largest `topk` a request may ask for.
    max_topk: int = 100
    #: Most hits in one reply (queries x topk): bounds the reply's rows and the ranking's memory before the search.
    max_hits: int = 65536
    #: Largest reply (bytes of JSON); a request whose reply would be larger is refused (413).
    max_reply_bytes: int = 64 << 20
    #: Seconds a connection has to send each full request (from its connect, or the end of the previous
    #: reply: an idle keep-alive connection is closed after it), and to take each reply.
    timeout_s: float = 10.0
    #: Connections served at once; the next ones get a 503 at once.
    max_connections: int = 64
    #: Threads calling `retriever.search` (the worker pool). Two: while one searches (the bm25 retriever searches one
    #: batch at a time), the other fetches its batch's passages and handler threads encode replies. On a shared
    #: 2-core machine (docs/search.md "Paper scale") 2 workers served more queries/s than 1 in 5 of 6 paired runs at
    #: 8-64 clients x 256 queries, at about the same CPU per query (within the noise). A dense (FAISS) retriever
    #: releases the GIL while it scores and can use more.
    workers: int = 2
    #: Most queries in one `retriever.search` call: waiting requests (same topk) are taken together up to it, a larger
    #: request is searched in parts of it. Bounds the search's batch memory (bm25s: one score row per query at a time).
    max_batch: int = 1024
    #: Most queries waiting to be searched, all requests together; a request that would pass it gets 429 at once (a
    #: request arriving when nothing waits is always taken). Bounds the queue's memory and its latency.
    max_pending: int = 16384
    #: MiB of encoded replies kept for recent (query, topk, return_scores) triples (0: no cache).
    cache_mb: int = 64


def _check_request(request: Any, default_topk: int, limits: Limits) -> tuple[list[str], int, bool]:
    """(queries, topk, return_scores) of a parsed body; `Refused` (400/413) when malformed or over the limits."""
    if not isinstance(request, dict) or not isinstance(request.get("queries"), list) \
            or not all(isinstance(q, str) for q in request["queries"]):
        raise Refused(400, 'the body must be {"queries": [str, ...], "topk": int, "return_scores": bool}')
    queries = request["queries"]
    if len(queries) > limits.max_queries:
        raise Refused(413, f"{len(queries)} queries: at most {limits.max_queries} per request")
    longest = max(map(len, queries), default=0)
    if longest > limits.max_query_chars:
        raise Refused(413, f"a query of {longest} characters: at most {limits.max_query_chars}")
    total = sum(map(len, queries))
    if total > limits.max_request_chars:
        raise Refused(413, f"queries of {total} characters in all: at most {limits.max_request_chars} per request")
    topk = request.get("topk")
    if topk is None:
        topk = default_topk
    # bool is an int in Python: `true` is refused, not read as 1; 0, "3" and 2.5 are refused, not rewritten
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= limits.max_topk:
        raise Refused(400, f"topk must be an integer from 1 to {limits.max_topk}, got {json.dumps(topk)[:40]}")
    if len(queries) * topk > limits.max_hits:
        raise Refused(413, f"{len(queries)} queries x topk {topk} = {len(queries) * topk} hits: at most {limits.max_hits}")
    return_scores = request.get("return_scores", False)
    if not isinstance(return_scores, bool):
        raise Refused(400, "return_scores must be true or false")
    return queries, topk, return_scores


def _encode_row(row: list, return_scores: bool) -> str:
    """One query's hits as the JSON text of Search-R1's reply (ASCII: `json.dumps` escapes the rest)."""
    if return_scores:
        items = [{"document": {"id": h.id, "title": h.title, "contents": h.contents}, "score": h.score} for h in row]
    else:
        items = [{"id": h.id, "title": h.title, "contents": h.contents} for h in row]
    return json.dumps(items)


def _join_reply(parts: Iterable[str], max_bytes: int) -> bytes:
    """`{"result": [part, ...]}` as bytes; `Refused` (413) as soon as it would pass `max_bytes`."""
    kept, size = [], len('{"result": []}')
    for i, part in enumerate(parts):
        size += len(part) + 2 * (i > 0)
        if size > max_bytes:
            raise Refused(413, f"the reply would pass {max_bytes} bytes: ask fewer queries or a smaller topk")
        kept.append(part)
    return ('{"result": [' + ", ".join(kept) + "]}").encode()


class _ReplyCache:
    """LRU of encoded rows by (query, topk, return_scores), at most `max_bytes` of text (keys counted too)."""

    _OVERHEAD = 200  # bytes per entry beside the strings (tuple, dict slot)

    def __init__(self, max_bytes: int):
        self.max_bytes, self.bytes, self.hits = max_bytes, 0, 0
        self._rows: OrderedDict[tuple, str] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple) -> Optional[str]:
        with self._lock:
            row = self._rows.get(key)
            if row is None:
                return None
            self._rows.move_to_end(key)
            self.hits += 1
            return row

    def put(self, key: tuple, row: str) -> None:
        size = len(row) + len(key[0]) + self._OVERHEAD
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._rows.pop(key, None)
            if old is not None:
                self.bytes -= len(old) + len(key[0]) + self._OVERHEAD
            self._rows[key] = row
            self.bytes += size
            while self.bytes > self.max_bytes:
                k, v = self._rows.popitem(last=False)
                self.bytes -= len(v) + len(k[0]) + self._OVERHEAD


class _Job:
    """Queries of one request (or a part of at most max_batch) waiting for a worker."""

    __slots__ = ("queries", "topk", "rows", "error", "done")

    def __init__(self, queries: list[str], topk: int):
        self.queries, self.topk, self.rows, self.error = queries, topk, None, None
        self.done = threading.Event()


class _Batcher:
    """The worker pool: `workers` threads, each taking the waiting jobs of one topk (in arrival order, up to
    `max_batch` queries) into one `retriever.search` call. At most `max_pending` queries wait (429 beyond)."""

    def __init__(self, retriever: Retriever, limits: Limits):
        self.retriever, self.max_batch, self.max_pending = retriever, limits.max_batch, limits.max_pending
        self.calls = 0  # retriever.search calls made (the test of coalescing reads it)
        self._jobs: deque[_Job] = deque()
        self._waiting = 0  # queries in self._jobs
        self._cond = threading.Condition()
        self._stop = False
        self._threads = [threading.Thread(target=self._run, name=f"emapg-retriever-worker-{i}", daemon=True)
                         for i in range(limits.workers)]
        for t in self._threads:
            t.start()

    def search(self, queries: list[str], topk: int) -> list[list]:
        """Hits per query (in order), searched by the pool; `Refused` 429 when the queue is full, 500 when the
        retriever raised (its exception's class and first line)."""
        jobs = [_Job(queries[s:s + self.max_batch], topk) for s in range(0, len(queries), self.max_batch)]
        with self._cond:
            if self._waiting and self._waiting + len(queries) > self.max_pending:
                raise Refused(429, f"busy: {self._waiting} queries are waiting to be searched (at most "
                                   f"{self.max_pending}); retry later")
            self._jobs.extend(jobs)
            self._waiting += len(queries)
            self._cond.notify(len(jobs))
        for job in jobs:
            job.done.wait()
        for job in jobs:
            if job.error is not None:
                raise job.error
        return [row for job in jobs for row in job.rows]

    def _take(self) -> list[_Job]:
        """The first waiting job and the next ones of its topk while they fit in max_batch (called locked)."""
        first = self._jobs.popleft()
        taken, n = [first], len(first.queries)
        for job in list(self._jobs):
            if job.topk == first.topk and n + len(job.queries) <= self.max_batch:
                self._jobs.remove(job)
                taken.append(job)
                n += len(job.queries)
        self._waiting -= n
        return taken

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                jobs = self._take()
            queries = [q for job in jobs for q in job.queries]
            try:
                self.calls += 1
                rows = self.retriever.search(queries, jobs[0].topk)
                if len(rows) != len(queries):
                    raise RuntimeError(f"{len(rows)} result lists for {len(queries)} queries")
                error = None
            except Exception as e:  # noqa: BLE001  a retriever bug is this request's 500, not the server's end
                rows, error = [], Refused(500, f"the retriever failed: {type(e).__name__}: "
                                               f"{(str(e).splitlines() or [''])[0][:200]}")
            start = 0
            for job in jobs:
                job.rows, job.error = rows[start:start + len(job.queries)], error
                start += len(job.queries)
                job.done.set()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()


class Searcher:
    """A request's queries to its reply bytes: identical queries once, the cache, then the worker pool."""

    def __init__(self, retriever: Retriever, limits: Limits):
        self.limits = limits
        self.batcher = _Batcher(retriever, limits)
        self.cache = _ReplyCache(limits.cache_mb << 20) if limits.cache_mb > 0 else None

    def reply(self, queries: list[str], topk: int, return_scores: bool) -> bytes:
        """The `/retrieve` reply's JSON bytes; `Refused` (413 reply too large, 429 busy, 500 retriever failed)."""
        rows: dict[str, str] = {}
        todo = []
        for q in dict.fromkeys(queries):  # each distinct query once, in order
            row = self.cache.get((q, topk, return_scores)) if self.cache else None
            if row is None:
                todo.append(q)
            else:
                rows[q] = row
        if todo:
            for q, hits in zip(todo, self.batcher.search(todo, topk)):
                rows[q] = _encode_row(hits, return_scores)
                if self.cache:
                    self.cache.put((q, topk, return_scores), rows[q])
        return _join_reply([rows[q] for q in queries], self.limits.max_reply_bytes)

    def close(self) -> None:
        self.batcher.stop()


class RetrieverServer(BoundedServer):
    """A `BoundedServer` (emapg_cli/serve/http_server.py: connections, deadlines, bodies) over one `Searcher`."""

    watchdog_name = "emapg-retriever-watchdog"

    def __init__(self, address: tuple[str, int], handler: type, limits: Limits, retriever: Retriever,
                 default_topk: int = 3, rows: int | None = None):
        self.limits, self.retriever, self.default_topk, self.rows = limits, retriever, default_topk, rows
        self.searcher = Searcher(retriever, limits)
        try:
            super().__init__(address, handler, max_connections=limits.max_connections, timeout_s=limits.timeout_s,
                             max_body_bytes=limits.max_body_bytes)
        except BaseException:
            self.searcher.close()
            raise

    def server_close(self) -> None:
        self.searcher.close()
        super().server_close()


class _Handler(BoundedHandler):
    """One connection of a `RetrieverServer`: `/retrieve` and `/health`, every refusal a JSON error."""

    server: RetrieverServer

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path == "/health":
            self.send_json(200, {"status": "ok", "rows": self.server.rows})
        else:
            self.send_json(404, {"error": f"no route {self.path[:200]} (POST /retrieve, GET /health)"})

    def _answer(self, body: bytes) -> tuple[int, dict | bytes]:
        """(status, reply) to a `/retrieve` body: parsed and checked one request at a time, then searched by the
        worker pool (with the waiting queries of other requests)."""
        server = self.server
        with server.work:
            try:
                request = json.loads(body or b"null")
                queries, topk, return_scores = _check_request(request, server.default_topk, server.limits)
            except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, nested too deeply
                return 400, {"error": f"the body is not JSON: {str(e)[:200] or type(e).__name__}"}
            except Refused as e:
                return e.code, {"error": str(e)}
            finally:
                request = None  # the parsed body is freed before the next one is parsed
        try:
            return 200, server.searcher.reply(queries, topk, return_scores)
        except Refused as e:
            return e.code, {"error": str(e)}

    def do_POST(self) -> None:  # noqa: N802
        if self.path != "/retrieve":
            self.refuse(404, f"no route {self.path[:200]} (POST /retrieve)", unread=True)
            return
        body = self.read_body()
        if body is None:
            return
        # waiting for the work lock and the search are bounded by the query limits, not by the clock
        self.deadline(None)
        code, reply = self._answer(body)
        del body
        self.send_json(code, reply)


def make_server(retriever: Retriever, host: str = "127.0.0.1", port: int = 8000, default_topk: int = 3,
                rows: int | None = None, limits: Limits = Limits()) -> RetrieverServer:
    """A bound (not yet serving) server; call `serve_forever()` (port 0 picks a free port: `server.server_address`)."""
    return RetrieverServer((host, port), _Handler, limits, retriever, default_topk=default_topk, rows=rows)
