"""Retrievers: bm25 index/query (CLI), the Search-R1 HTTP server and client on localhost, bad input, HotpotQA recall."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from emapg_cli.errors import UserError
from emapg_cli.retrieval.bm25 import BM25Retriever, build_index
from emapg_cli.fileio import sha256_file
from emapg_cli.retrieval.corpus import paragraph_contents
from emapg_cli.retrieval.http import HTTPRetriever
from train_helpers import free_port

DOCS = [
    ("Evan Morris", "Evan Morris was a lobbyist for Genentech in Washington."),
    ("Horatio Hale", "Horatio Hale was an ethnologist who studied Algonkin vocabulary."),
    ("Dibba Al-Hisn", "Dibba Al-Hisn is a town where the Portuguese built a fort."),
    ("Ao Oni", "Ao Oni is a Japanese horror film based on a video game."),
    ("Titan IIIE", "Titan IIIE was the rocket that launched Voyager 2 towards Uranus."),
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    path.write_text("".join(json.dumps({"id": f"d{i}", "contents": paragraph_contents(t, x)}) + "\n" for i, (t, x) in enumerate(DOCS)))
    return path


@pytest.fixture(scope="module")
def index(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("idx") / "index"
    build_index(corpus, out)
    return out


def test_index_manifest_and_distinct_hits(corpus, index):
    manifest = json.loads((index / "manifest.json").read_text())
    assert manifest["rows"] == 5 and manifest["corpus_sha256"] == sha256_file(corpus)
    r = BM25Retriever.load(index)
    hits = r.search(["lobbyist Genentech", "Algonkin ethnologist", "Portuguese fort", "rocket Uranus Voyager"], 2)
    # the bm25s regression of FlashRAG#103 returned the same hits for every query: each query must find its own doc
    assert [h[0].id for h in hits] == ["d0", "d1", "d2", "d4"]
    assert hits[0][0].title == "Evan Morris" and hits[0][0].contents.startswith('"Evan Morris"\n')
    assert hits[0][0].score > hits[0][1].score >= 0
    assert len(r.search(["anything"], 50)[0]) == 5  # topk capped at the corpus size


def test_query_cli_json(index, cli):
    r = cli("retriever", "query", str(index), "Horatio Hale Algonkin", "--topk", "2", "--json")
    assert r.returncode == 0, r.stderr
    hits = json.loads(r.stdout)
    assert len(hits) == 2 and set(hits[0]) == {"id", "title", "contents", "score"} and hits[0]["id"] == "d1"


def test_corpus_without_contents_is_one_line_error(tmp_path, cli):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "1", "contents": "T\\ntext"}\n{"id": "2", "text": "no contents"}\n')
    out = tmp_path / "idx"
    r = cli("retriever", "index", str(bad), "--out", str(out))
    assert r.returncode == 2 and "row 2 has no 'contents'" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not out.exists() and not (tmp_path / "idx.tmp").exists()  # nothing half-written


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise AssertionError(f"server exited: {proc.stderr.read()}")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if json.loads(r.read())["status"] == "ok":
                    return
        except OSError:
            time.sleep(0.2)
    raise AssertionError("server did not come up")


def test_http_round_trip_against_serve(index):
    """`emapg retriever serve` in a subprocess; raw Search-R1 JSON over HTTP, then the http client; both = in-process."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "emapg_cli", "retriever", "serve", str(index), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_healthy(f"http://127.0.0.1:{port}/health", proc)
        body = json.dumps({"queries": ["Portuguese fort", "Japanese horror"], "topk": 2, "return_scores": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/retrieve", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            reply = json.loads(r.read())
        assert [len(x) for x in reply["result"]] == [2, 2]
        first = reply["result"][0][0]
        assert set(first) == {"document", "score"} and first["document"]["id"] == "d2"
        assert first["document"]["contents"].startswith('"Dibba Al-Hisn"\n')
        plain = json.dumps({"queries": ["Portuguese fort"], "topk": 1, "return_scores": False}).encode()
        with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/retrieve", data=plain), timeout=10) as r:
            assert json.loads(r.read())["result"][0][0]["id"] == "d2"  # Search-R1's return_scores=false shape

        client = HTTPRetriever(f"http://127.0.0.1:{port}/retrieve", timeout_s=10, retries=0)
        local = BM25Retriever.load(index)
        queries = ["lobbyist Genentech", "rocket Uranus", "Algonkin"]
        assert client.search(queries, 3) == local.search(queries, 3)  # same ids, titles, contents, scores
        bad = urllib.request.Request(f"http://127.0.0.1:{port}/retrieve", data=b'{"queries": "not a list"}')
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(bad, timeout=10)
        assert e.value.code == 400
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_unreachable_server_is_one_line_error():
    port = free_port()  # nothing listens there
    client = HTTPRetriever(f"http://127.0.0.1:{port}/retrieve", timeout_s=2, retries=2, backoff_s=0.01)
    t0 = time.perf_counter()
    with pytest.raises(UserError, match=r"failed after 3 tries: .*refused") as e:
        client.search(["q"], 3)
    assert "\n" not in str(e.value) and time.perf_counter() - t0 < 10  # back-off 0.01 + 0.02 s


def test_hotpotqa_gold_recall(shared_data, tmp_path, cli, capsys):
    """bm25 over the 4,858 HotpotQA paragraphs: gold-paragraph recall@3 of the 500 questions (Search-R1 notes: 0.66)."""
    src = shared_data / "search" / "hotpotqa_dev_ircot500.jsonl"
    corpus_dir = tmp_path / "corpus"
    r = cli("prepare", "hotpotqa-corpus", "--from", str(src), "--out", str(corpus_dir))
    assert r.returncode == 0, r.stderr
    assert json.loads((corpus_dir / "manifest.json").read_text())["rows"] == 4858
    t0 = time.perf_counter()
    build_index(corpus_dir / "corpus.jsonl", tmp_path / "index")
    t_index = time.perf_counter() - t0
    retriever = BM25Retriever.load(tmp_path / "index")
    rows = [json.loads(line) for line in open(src)]
    t0 = time.perf_counter()
    hits = retriever.search([x["question_text"] for x in rows], 10)
    t_query = time.perf_counter() - t0
    recall = {}
    for k in (3, 10):
        per_question = []
        for x, h in zip(rows, hits):
            gold = {" ".join(paragraph_contents(c["title"].strip(), c["paragraph_text"]).split()) for c in x["contexts"] if c["is_supporting"]}
            got = {" ".join(d.contents.split()) for d in h[:k]}
            per_question.append(len(gold & got) / len(gold))  # share of the question's gold paragraphs in the top k
        recall[k] = sum(per_question) / len(per_question)
    with capsys.disabled():
        print(f"\nhotpotqa bm25: recall@3 {recall[3]:.3f}, recall@10 {recall[10]:.3f}, index {t_index:.2f} s, "
              f"500 queries {t_query:.2f} s")
    # measured 0.660 / 0.916 with bm25s 0.3.16; a broken index (same hits for every query) gives ~0
    assert 0.62 <= recall[3] <= 0.70 and recall[10] > 0.88


# ---------------------------------------------------------------- the server's bounds and the client's checks (issue 20)

def test_server_request_checks_refuse_not_rewrite():
    """topk 0 / true / "3" / 2.5 are refused (0 used to become the default 3, true to become 1); the limits on
    queries, topk and hits (queries x topk) are 413/400 before any search."""
    from emapg_cli.retrieval.server import Limits, Refused, _check_request

    limits = Limits(max_queries=4, max_topk=5, max_hits=8)
    assert _check_request({"queries": ["a"], "topk": None}, 3, limits) == (["a"], 3, False)  # null: the default
    assert _check_request({"queries": ["a", "b"], "topk": 4, "return_scores": True}, 3, limits) == (["a", "b"], 4, True)
    for topk in (0, True, "3", 2.5, -1, 6):
        with pytest.raises(Refused, match="topk must be an integer from 1 to 5") as e:
            _check_request({"queries": ["a"], "topk": topk}, 3, limits)
        assert e.value.code == 400
    with pytest.raises(Refused, match="5 queries: at most 4") as e:
        _check_request({"queries": ["a"] * 5, "topk": 1}, 3, limits)
    assert e.value.code == 413
    with pytest.raises(Refused, match="3 queries x topk 3 = 9 hits: at most 8"):  # 3 * 3 = 9 > 8
        _check_request({"queries": ["a"] * 3, "topk": 3}, 3, limits)


def test_server_reply_size_cap():
    """The reply is refused as soon as its JSON passes the cap; at the cap exactly it is sent."""
    from emapg_cli.retrieval.base import Hit
    from emapg_cli.retrieval.server import Refused, _encode_row, _join_reply

    def _encode_reply(hits, return_scores, max_bytes):  # the reply as Searcher.reply builds it from its rows
        return _join_reply((_encode_row(row, return_scores) for row in hits), max_bytes)

    hits = [[Hit("1", "T", "T\nx", 1.0)]] * 2
    full = _encode_reply(hits, False, 10 ** 6)
    assert json.loads(full) == {"result": [[{"id": "1", "title": "T", "contents": "T\nx"}]] * 2}
    assert _encode_reply(hits, False, len(full)) == full  # the size counted is the size sent
    with pytest.raises(Refused, match="reply would pass") as e:
        _encode_reply(hits, False, len(full) - 1)
    assert e.value.code == 413


def test_serve_help_and_defaults_match_the_constants(cli):
    """Every bound of `retriever serve` is an option whose default is the server's named constant."""
    import inspect

    from emapg_cli.cli.retriever_cmd import serve
    from emapg_cli.retrieval.server import Limits

    defaults = {k: p.default for k, p in inspect.signature(serve).parameters.items()}
    assert {f: defaults[f] for f in Limits.__dataclass_fields__} == vars(Limits())
    r = cli("retriever", "serve", "--help")
    for option in ("--max-body-bytes", "--max-queries", "--max-query-chars", "--max-request-chars", "--max-topk", "--max-hits", "--max-reply-bytes", "--timeout",
                   "--max-connections"):
        assert option in r.stdout, option


def test_search_url_must_be_http():
    from pydantic import ValidationError

    from emapg_cli.config.models import SearchConfig

    assert SearchConfig(url="https://h:1/retrieve").url == "https://h:1/retrieve"
    for url in ("notaurl", "file:///etc/passwd", "ftp://h/x", "http://"):
        with pytest.raises(ValidationError, match="http:// or https://"):
            SearchConfig(url=url)
    with pytest.raises(UserError, match="search.url must be an http"):
        HTTPRetriever("file:///etc/passwd")


@pytest.mark.parametrize("body, needle", [
    (b'{"result": [["\xff"]]}', r"not UTF-8 \(byte 14\)"),  # 14 bytes `{"result": [["` come first
    (b"[" * 50_000 + b"]" * 50_000, "nested too deeply"),
    (b"<html>", "not JSON"),
    (b'{"result": [[{"document": {"contents": 7}}]]}', "document.contents string"),
    (b'{"result": [[], []]}', "2 result lists for 1 queries"),
    (b'{"result": [' + b" " * 300_000 + b"]}", "over 200000 bytes"),
    (b'{"result": [[{"document": {"contents": "x"}, "score": 1' + b"0" * 400 + b'}]]}', "not a finite number"),
])
def test_client_bad_reply_is_one_line(body, needle):
    """A reply the client cannot use is one UserError line naming the URL and what was wrong (no retry)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    import threading

    calls = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            calls.append(1)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/retrieve"
    try:
        client = HTTPRetriever(url, timeout_s=10, retries=2, backoff_s=0.01, max_reply_bytes=200_000)
        with pytest.raises(UserError, match=needle) as e:
            client.search(["q"], 3)
        assert "\n" not in str(e.value) and url in str(e.value) and calls == [1]
    finally:
        server.shutdown()
        server.server_close()


def test_server_survives_a_hostile_body_in_process(index):
    """In-process server: Content-Length -1 is 400 without reading, a nested body is 400, /health still answers."""
    import socket
    import threading

    from emapg_cli.retrieval.server import make_server

    server = make_server(BM25Retriever.load(index), port=0, rows=5)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    port = server.server_address[1]
    try:
        def ask(raw: bytes) -> bytes:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(raw)
                s.shutdown(socket.SHUT_WR)
                return b"".join(iter(lambda: s.recv(65536), b""))

        assert ask(b"POST /retrieve HTTP/1.1\r\nContent-Length: -1\r\n\r\n" + b"x" * 100_000).startswith(b"HTTP/1.1 400")
        nested = b"[" * 100_000 + b"]" * 100_000
        reply = ask(b"POST /retrieve HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(nested) + nested)
        assert reply.startswith(b"HTTP/1.1 400") and b'"error"' in reply
        assert b'"status": "ok"' in ask(b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n")
    finally:
        server.shutdown()
        server.server_close()


def test_client_splits_large_batches(monkeypatch):
    """2,500 queries with BATCH_QUERIES 256 are ten requests (9 x 256 + 196), hits in query order."""
    import emapg_cli.retrieval.http as http

    sent = []

    def post(self, payload, url):
        sent.append(len(payload["queries"]))
        return {"result": [[{"document": {"id": q, "contents": q}, "score": 1.0}] for q in payload["queries"]]}

    monkeypatch.setattr(http.HTTPRetriever, "_post", post)
    queries = [f"q{i}" for i in range(2500)]
    hits = http.HTTPRetriever("http://127.0.0.1:1/retrieve").search(queries, 1)
    assert sent == [256] * 9 + [196] and [h[0].id for h in hits] == queries  # 2,500 - 9 x 256 = 196


def test_server_over_max_connections_is_503_then_serves(index):
    """max_connections 1: while one client holds its connection, the next gets a 503 with a JSON error at once;
    once the first is closed (or times out: timeout 1 s), the next is served."""
    import socket
    import threading

    from emapg_cli.retrieval.server import Limits, make_server

    server = make_server(BM25Retriever.load(index), port=0, rows=5, limits=Limits(max_connections=1, timeout_s=1.0))
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    port = server.server_address[1]

    def health() -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n")
            return b"".join(iter(lambda: s.recv(65536), b""))

    try:
        holder = socket.create_connection(("127.0.0.1", port), timeout=10)
        time.sleep(0.2)  # the server has accepted it
        busy = health()
        assert busy.startswith(b"HTTP/1.1 503") and b'"error": "busy: 1 connections' in busy
        assert holder.recv(1) == b""  # the idle holder is closed after timeout_s = 1 s
        holder.close()
        time.sleep(0.2)
        assert health().startswith(b"HTTP/1.1 200")
    finally:
        server.shutdown()
        server.server_close()


def test_server_refuses_long_queries_before_searching():
    """A query over max_query_chars, or queries over max_request_chars in all, are 413 before any search (one
    16 MiB query used to hold the search lock for minutes); at the limits exactly they pass."""
    from emapg_cli.retrieval.server import Limits, Refused, _check_request

    limits = Limits(max_query_chars=4, max_request_chars=10)
    assert _check_request({"queries": ["abcd", "abcd", "ab"], "topk": 1}, 3, limits)[0] == ["abcd", "abcd", "ab"]
    with pytest.raises(Refused, match="a query of 5 characters: at most 4") as e:
        _check_request({"queries": ["a", "abcde"], "topk": 1}, 3, limits)
    assert e.value.code == 413
    with pytest.raises(Refused, match="queries of 11 characters in all: at most 10") as e:  # 4 + 4 + 3 = 11
        _check_request({"queries": ["abcd", "abcd", "abc"], "topk": 1}, 3, limits)
    assert e.value.code == 413


def test_client_cuts_long_queries_and_splits_by_characters(monkeypatch):
    """The client never sends what a server with the default limits refuses: a 10,000-character query is cut to
    MAX_QUERY_CHARS (4,096); 600 queries of 4,096 characters (2,457,600 in all) go as 256 + 256 + 88, since
    256 x 4,096 = 1,048,576 = MAX_REQUEST_CHARS."""
    import emapg_cli.retrieval.http as http
    from emapg_cli.retrieval.server import Limits, _check_request

    MAX_QUERY_CHARS, MAX_REQUEST_CHARS = Limits.max_query_chars, Limits.max_request_chars  # the server's defaults

    sent = []

    def post(self, payload, url):
        _check_request(payload, 3, Limits())  # the server's own check, default limits
        sent.append([len(q) for q in payload["queries"]])
        return {"result": [[{"document": {"id": "1", "contents": q}, "score": 1.0}] for q in payload["queries"]]}

    monkeypatch.setattr(http.HTTPRetriever, "_post", post)
    client = http.HTTPRetriever("http://127.0.0.1:1/retrieve")
    assert (MAX_QUERY_CHARS, MAX_REQUEST_CHARS) == (4096, 1 << 20)
    assert client.search(["one " * 2500], 1)[0][0].contents == ("one " * 2500)[:4096] and sent == [[4096]]
    sent.clear()
    client.search([f"{i:04d}" + "x" * 4092 for i in range(600)], 1)  # distinct: identical queries are sent once
    assert [len(b) for b in sent] == [256, 256, 88]


def test_server_busy_drain_is_bounded():
    """The accept loop's 503 drops at most LINGER_BYTES of what a client sends (it used to read until the client
    stopped: a client sending without end held the accept loop, so nobody else was even refused)."""
    from emapg_cli.serve import http_server
    from emapg_cli.retrieval import server as srv

    import socket

    ready, peer = socket.socketpair()  # select() sees data waiting on the request (the 503 peeks at its first line)
    peer.sendall(b"x")

    class Flood:  # a client that always has 64 KiB more to send
        read = 0

        def fileno(self):
            return ready.fileno()

        def recv(self, n, flags=0):
            if flags & socket.MSG_PEEK:
                return b"x" * n  # a peek reads nothing away
            self.read += n
            if self.read > 64 * http_server.LINGER_BYTES:
                raise OSError("stop: unbounded")
            return b"x" * n

        def settimeout(self, t): pass
        def setblocking(self, b): pass
        def sendall(self, data): pass
        def shutdown(self, how): pass
        def close(self): pass

    server = srv.RetrieverServer.__new__(srv.RetrieverServer)
    server.max_connections = srv.Limits().max_connections
    flood = Flood()
    server._busy(flood)
    ready.close(), peer.close()
    assert flood.read <= http_server.LINGER_BYTES


def test_server_parses_and_searches_one_request_at_a_time(index):
    """While another request holds the server's work lock (parsing or searching), a POST waits for it: at most one
    parsed body is in memory at once; once the lock is free it is answered."""
    import socket
    import threading

    from emapg_cli.retrieval.server import make_server

    server = make_server(BM25Retriever.load(index), port=0, rows=5)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    body = b'{"queries": ["fort"], "topk": 1}'
    try:
        with server.work, socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=10) as s:
            s.sendall(b"POST /retrieve HTTP/1.1\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
            s.settimeout(0.5)
            with pytest.raises(socket.timeout):
                s.recv(1)  # no answer while the lock is held
            server.work.release()
            try:
                s.settimeout(10)
                assert b"".join(iter(lambda: s.recv(65536), b"")).startswith(b"HTTP/1.1 200")
            finally:
                server.work.acquire()
    finally:
        server.shutdown()
        server.server_close()
