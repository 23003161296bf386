"""The retriever server under load and its client against several servers (issue 24): in-process fake servers and
fake retrievers only, each test well under a second."""

from __future__ import annotations

import json
import threading
import urllib.request
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from emapg_cli.errors import UserError
from emapg_cli.retrieval.base import Hit
from emapg_cli.retrieval.http import HTTPRetriever
from emapg_cli.retrieval.server import Limits, Refused, Searcher, make_server
from train_helpers import free_port


class CountingRetriever:
    """Hit `doc-<query>` for each query; records every search call's queries; `gate` (if set) holds each call."""

    def __init__(self, gate: threading.Event | None = None, fail: bool = False):
        self.calls: list[list[str]] = []
        self.gate, self.fail = gate, fail

    def search(self, queries, topk):
        self.calls.append(list(queries))
        if self.gate is not None:
            self.gate.wait(5)
        if self.fail:
            raise KeyError("broken index")
        return [[Hit(f"doc-{q}", q, f"{q}\nbody", 1.0)] for q in queries]

    def close(self):
        pass


@contextmanager
def fake_server(answer):
    """A Search-R1 /retrieve server on loopback: answer(queries) -> (status, body dict); yields (url, seen batches)."""
    seen: list[list[str]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            queries = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["queries"]
            seen.append(queries)
            code, body = answer(queries)
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/retrieve", seen
    finally:
        server.shutdown()
        server.server_close()


def ok(queries):
    return 200, {"result": [[{"document": {"id": f"doc-{q}", "contents": f"{q}\nbody"}, "score": 1.0}] for q in queries]}


def test_client_sends_identical_queries_once():
    """5 queries, 2 distinct (a turn's n samples searching the same words): one request of 2; hits fanned back out."""
    with fake_server(ok) as (url, seen):
        hits = HTTPRetriever(url, retries=0).search(["a", "b", "a", "a", "b"], 1)
    assert seen == [["a", "b"]]
    assert [h[0].id for h in hits] == ["doc-a", "doc-b", "doc-a", "doc-a", "doc-b"]


def test_client_fails_over_to_the_second_url():
    """The first URL refuses connections: with retries 0 (one round) the request goes to the second at once."""
    down = f"http://127.0.0.1:{free_port()}/retrieve"  # nothing listens there
    with fake_server(ok) as (url, seen):
        client = HTTPRetriever([down, url], retries=0, timeout_s=5)
        assert [h[0].id for h in client.search(["x", "y"], 1)] == ["doc-x", "doc-y"]
        assert [h[0].id for h in client.search(["z"], 1)] == ["doc-z"]  # the second call starts at the second URL
    assert seen == [["x", "y"], ["z"]]
    with pytest.raises(UserError, match=r"failed after 2 tries: .*refused"):  # one round x 2 URLs, both down
        HTTPRetriever([down, down], retries=0, timeout_s=5).search(["x"], 1)


def test_client_retry_resends_only_the_failed_request(monkeypatch):
    """BATCH_QUERIES 2: q0..q4 are requests [q0 q1] [q2 q3] [q4]; the one holding q2 gets a 503 once, so the
    retry round (after backoff_s) sends [q2 q3] alone: 4 requests in all, every query answered once."""
    import emapg_cli.retrieval.http as http

    monkeypatch.setattr(http, "BATCH_QUERIES", 2)
    failed = []

    def flaky(queries):
        if "q2" in queries and not failed:
            failed.append(1)
            return 503, {"error": "down for a moment"}
        return ok(queries)

    with fake_server(flaky) as (url, seen):
        hits = HTTPRetriever(url, retries=1, backoff_s=0.01).search([f"q{i}" for i in range(5)], 1)
    assert seen == [["q0", "q1"], ["q2", "q3"], ["q4"], ["q2", "q3"]]
    assert [h[0].id for h in hits] == [f"doc-q{i}" for i in range(5)]


def test_client_retries_429_but_not_413():
    """429 (the server's queue is full) is retried like a 5xx; 413 (over its limits) is one UserError line at once."""
    codes = [429, 200]
    with fake_server(lambda q: (codes.pop(0), {"error": "busy"}) if codes[0] != 200 else ok(q)) as (url, seen):
        assert HTTPRetriever(url, retries=1, backoff_s=0.01).search(["a"], 1)[0][0].id == "doc-a"
    assert len(seen) == 2
    with fake_server(lambda q: (413, {"error": "3 queries: at most 2 per request"})) as (url, seen):
        with pytest.raises(UserError, match=r"HTTP 413 .*: 3 queries: at most 2 per request$") as e:
            HTTPRetriever(url, retries=3, backoff_s=0.01).search(["a", "b", "c"], 1)
    assert len(seen) == 1 and "\n" not in str(e.value)


def test_server_oversize_request_is_one_413_line():
    """The real server, max_queries 2: 3 queries are a 413 with a one-line JSON error, and the next request is served."""
    server = make_server(CountingRetriever(), port=0, rows=1, limits=Limits(max_queries=2))
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/retrieve"

    def post(queries):
        req = urllib.request.Request(url, data=json.dumps({"queries": queries, "topk": 1}).encode())
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.loads(r.read())

    try:
        with pytest.raises(urllib.error.HTTPError) as e:
            post(["a", "b", "c"])
        assert e.value.code == 413 and json.loads(e.value.read()) == {"error": "3 queries: at most 2 per request"}
        assert post(["a", "a"])["result"] == [[{"id": "doc-a", "title": "a", "contents": "a\nbody"}]] * 2
    finally:
        server.shutdown()
        server.server_close()


def test_server_cache_hit_and_duplicates_searched_once():
    """["a", "b", "a"] searches ["a", "b"] once; asking again is answered from the cache (no search); another topk
    or return_scores is another entry."""
    retriever = CountingRetriever()
    searcher = Searcher(retriever, Limits())
    try:
        first = searcher.reply(["a", "b", "a"], 1, False)
        assert searcher.reply(["a", "b", "a"], 1, False) == first
        assert retriever.calls == [["a", "b"]] and searcher.cache.hits == 2  # "a" and "b" the second time
        searcher.reply(["a"], 2, False)
        searcher.reply(["a"], 1, True)
        assert retriever.calls == [["a", "b"], ["a"], ["a"]]
    finally:
        searcher.close()
    nocache = Searcher(retriever, Limits(cache_mb=0))
    nocache.reply(["a"], 1, False)
    nocache.close()
    assert retriever.calls[-1] == ["a"] and nocache.cache is None


def test_server_cache_is_bounded_lru():
    """Entries cost len(row) + len(query) + 200 bytes: with room for two, the least recently used goes first."""
    from emapg_cli.retrieval.server import _ReplyCache

    cache = _ReplyCache(2 * (10 + 1 + 200))  # two entries of a 10-character row and a 1-character query
    cache.put(("a", 1, False), "x" * 10)
    cache.put(("b", 1, False), "y" * 10)
    assert cache.get(("a", 1, False)) == "x" * 10  # "a" is now the most recent
    cache.put(("c", 1, False), "z" * 10)
    assert cache.get(("b", 1, False)) is None and cache.get(("a", 1, False)) and cache.bytes == 2 * 211


def test_server_coalesces_waiting_requests_into_one_search():
    """While the worker searches request 1, requests 2-4 wait; the next search call takes all three together."""
    gate = threading.Event()
    retriever = CountingRetriever(gate)
    searcher = Searcher(retriever, Limits(workers=1, cache_mb=0))  # one worker: it is busy with request 1
    replies = {}

    def ask(name, queries):
        replies[name] = json.loads(searcher.reply(queries, 1, False))

    threads = [threading.Thread(target=ask, args=("r1", ["a"]))]
    threads[0].start()
    while not retriever.calls:  # the worker holds request 1
        threading.Event().wait(0.005)
    threads += [threading.Thread(target=ask, args=(f"r{i}", [f"q{i}", f"p{i}"])) for i in (2, 3, 4)]
    for t in threads[1:]:
        t.start()
    while searcher.batcher._waiting < 6:
        threading.Event().wait(0.005)
    gate.set()
    for t in threads:
        t.join(5)
    searcher.close()
    assert len(retriever.calls) == 2 and sorted(retriever.calls[1]) == ["p2", "p3", "p4", "q2", "q3", "q4"]
    assert replies["r3"]["result"][1][0]["id"] == "doc-p3"


def test_server_queue_full_is_429_and_retriever_error_is_500():
    """max_pending 2: with the worker busy and 2 queries waiting, a third request is 429 at once. A retriever that
    raises is a 500 naming the exception, and the pool keeps serving."""
    gate = threading.Event()
    retriever = CountingRetriever(gate)
    searcher = Searcher(retriever, Limits(workers=1, max_pending=2, cache_mb=0))
    threads = [threading.Thread(target=searcher.reply, args=(q, 1, False)) for q in (["a"], ["b", "c"])]
    threads[0].start()
    while not retriever.calls:
        threading.Event().wait(0.005)
    threads[1].start()
    while searcher.batcher._waiting < 2:
        threading.Event().wait(0.005)
    with pytest.raises(Refused, match="busy: 2 queries are waiting") as e:
        searcher.reply(["d"], 1, False)
    assert e.value.code == 429
    gate.set()
    for t in threads:
        t.join(5)
    retriever.fail = True
    with pytest.raises(Refused, match="the retriever failed: KeyError: 'broken index'") as e:
        searcher.reply(["e"], 1, False)
    assert e.value.code == 500
    retriever.fail = False
    assert json.loads(searcher.reply(["f"], 1, False))["result"][0][0]["id"] == "doc-f"
    searcher.close()


def test_search_url_list_is_checked():
    from pydantic import ValidationError

    from emapg_cli.config.models import SearchConfig

    urls = ["http://a:1/retrieve", "https://b:2/retrieve"]
    assert SearchConfig(url=urls).url == urls
    for bad in ([], ["http://a:1/retrieve", "file:///etc/passwd"]):
        with pytest.raises(ValidationError, match="empty list|http:// or https://"):
            SearchConfig(url=bad)
    with pytest.raises(UserError, match="search.url is an empty list"):
        HTTPRetriever([])
