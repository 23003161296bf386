"""`emapg retriever index|query|serve`: build a BM25 (or, with --dense, a FAISS) index of a corpus, query it, serve it
over HTTP (Search-R1 API)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from emapg_cli.cli.common import check_seconds_option, console, counting_bar
from emapg_cli.errors import UserError

app = typer.Typer(help="Retrieval for the search agent: index a JSONL corpus, query an index, serve it as a Search-R1 /retrieve server.",
                  no_args_is_help=True)


@app.command("index")
def index(
    corpus: Annotated[Path, typer.Argument(metavar="CORPUS.jsonl", help="Corpus in the FlashRAG layout: one {\"id\", \"contents\"} per line, the first line of contents being the title.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="New (or empty) folder for the index.")],
    dense: Annotated[Optional[str], typer.Option("--dense", metavar="MODEL", help="Build a dense index instead of BM25: encode the passages with this sentence-transformers model (hub name, e.g. intfloat/e5-base-v2, or local folder; a plain transformers folder gets mean pooling) into a FAISS inner-product index. Needs pip install 'emapg\\[dense]'.")] = None,
    faiss: Annotated[str, typer.Option("--faiss", help="With --dense: flat (exact, rows x dim x 4 bytes of memory), ivf (inverted lists: --nlist, --nprobe), ivfpq (ivf with vectors product-quantised to --pq-m bytes: a 32x smaller index for 768-dim, lower recall) or hnsw (graph: --hnsw-m, --ef-search); docs/search.md has the recall/speed trade-off.")] = "flat",
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, max=65536, help="With --dense: passages per encoder batch.")] = 64,
    query_prefix: Annotated[str, typer.Option("--query-prefix", help="With --dense: text put before every query (e5's convention).")] = "query: ",
    passage_prefix: Annotated[str, typer.Option("--passage-prefix", help="With --dense: text put before every passage (e5's convention).")] = "passage: ",
    max_length: Annotated[int, typer.Option("--max-length", min=1, max=8192, help="With --dense: texts are cut to this many tokens (256, as Search-R1's e5 server).")] = 256,
    nlist: Annotated[Optional[int], typer.Option("--nlist", min=1, help="With --faiss ivf or ivfpq: inverted lists (default 4*sqrt(rows), at most rows/39).")] = None,
    nprobe: Annotated[Optional[int], typer.Option("--nprobe", min=1, help="With --faiss ivf or ivfpq: lists scanned per query (default 32, at most nlist).")] = None,
    pq_m: Annotated[Optional[int], typer.Option("--pq-m", min=1, help="With --faiss ivfpq: bytes per vector (sub-quantisers of 8 bits; must divide the encoder's dimension; default dim/8).")] = None,
    hnsw_m: Annotated[Optional[int], typer.Option("--hnsw-m", min=2, max=256, help="With --faiss hnsw: graph links per vector (default 32).")] = None,
    ef_search: Annotated[Optional[int], typer.Option("--ef-search", min=1, help="With --faiss hnsw: candidates explored per query (default 128).")] = None,
    chunk_rows: Annotated[int, typer.Option("--chunk-rows", min=1, help="Rows read and tokenised at a time; the build's memory is the vocabulary plus one chunk (and one spill bucket), whatever the corpus size.")] = 10_000,
) -> None:
    """Build a BM25 index (bm25s) of CORPUS into --out, streaming it in chunks, with a manifest (corpus sha256, row count);
    with --dense MODEL a FAISS index of the passages' embeddings instead (docs/search.md, "Dense retrieval").

    CORPUS may be JSONL, gzipped JSONL (.jsonl.gz, as Search-R1's wiki-18 download) or parquet. The index is
    bm25s's saved layout (or the FAISS index) plus a doc store, both memory-mapped by `query` and `serve`."""
    if dense is not None and chunk_rows != 10_000:
        raise UserError("--chunk-rows applies to the bm25 index, not with --dense")
    if dense is not None:
        return _index_dense(corpus, out, dense, kind=faiss, batch_size=batch_size, query_prefix=query_prefix,
                            passage_prefix=passage_prefix, max_length=max_length, nlist=nlist, nprobe=nprobe,
                            hnsw_m=hnsw_m, ef_search=ef_search, pq_m=pq_m)
    dense_only = {"--faiss": faiss != "flat", "--batch-size": batch_size != 64, "--query-prefix": query_prefix != "query: ",
                  "--passage-prefix": passage_prefix != "passage: ", "--max-length": max_length != 256, "--nlist": nlist,
                  "--nprobe": nprobe, "--pq-m": pq_m, "--hnsw-m": hnsw_m, "--ef-search": ef_search}
    if any(v is not None and v is not False for v in dense_only.values()):
        raise UserError(f"{next(k for k, v in dense_only.items() if v is not None and v is not False)} applies only with --dense MODEL")
    from emapg_cli.retrieval.bm25 import build_index

    bar, start = counting_bar("indexing rows")  # total: rows, or None for a gzipped corpus
    with bar:
        manifest = build_index(corpus, out, progress=start, chunk=chunk_rows)
    console.print(f"indexed {manifest['rows']:,} documents in {manifest['index_s']:.2f} s -> {out} "
                  f"(corpus sha256 {manifest['corpus_sha256'][:12]}...)", highlight=False)


def _index_dense(corpus: Path, out: Path, model: str, **settings) -> None:
    """`emapg retriever index --dense MODEL`: encode with a progress bar, then one summary line."""
    from rich.progress import TimeRemainingColumn

    from emapg_cli.retrieval.dense import build_dense_index

    bar, start = counting_bar("encoding", TimeRemainingColumn())
    with bar:
        manifest = build_dense_index(corpus, out, model, progress=start, **settings)
    params = ", ".join(f"{k} {v}" for k, v in manifest["faiss"].items() if k != "kind")
    console.print(f"encoded {manifest['rows']:,} passages ({manifest['dim']}-dim, {manifest['pooling']} pooling) into a "
                  f"FAISS {manifest['faiss']['kind']}{f' ({params})' if params else ''} index in {manifest['index_s']:.2f} s "
                  f"-> {out}", markup=False, highlight=False)


@app.command("query")
def query(
    index_dir: Annotated[Path, typer.Argument(metavar="DIR", help="Index folder written by `emapg retriever index`.")],
    text: Annotated[str, typer.Argument(help="The query.")],
    topk: Annotated[int, typer.Option("--topk", "-k", min=1, help="Number of hits.")] = 3,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list of {\"id\", \"title\", \"contents\", \"score\"}.")] = False,
) -> None:
    """Print the top hits of one query (a bm25 or dense index, as its manifest says)."""
    from emapg_cli.retrieval import open_index

    hits = open_index(index_dir).search([text], topk)[0]
    if as_json:
        typer.echo(json.dumps([h.to_json() for h in hits], ensure_ascii=False, indent=2))
        return
    for rank, h in enumerate(hits, 1):
        body = h.contents.partition("\n")[2].replace("\n", " ")
        console.print(f"{rank}. [bold]{h.title}[/] (id {h.id}, score {h.score:.3f})", highlight=False)
        console.print(f"   {body[:300]}{'...' if len(body) > 300 else ''}", markup=False, highlight=False)


@app.command("serve")
def serve(
    index_dir: Annotated[Path, typer.Argument(metavar="DIR", help="Index folder written by `emapg retriever index`.")],
    host: Annotated[str, typer.Option("--host", help="Address to listen on (0.0.0.0: every interface).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="TCP port (0: any free port, printed at start).")] = 8000,
    topk: Annotated[int, typer.Option("--topk", min=1, help="Hits per query when a request gives no topk.")] = 3,
    max_body_bytes: Annotated[int, typer.Option("--max-body-bytes", min=1, help="Largest request body; a larger (or missing, or invalid) Content-Length is refused before reading (411/413).")] = 16 << 20,
    max_queries: Annotated[int, typer.Option("--max-queries", min=1, help="Most queries per request (one per active episode of a training turn); more: 413.")] = 4096,
    max_query_chars: Annotated[int, typer.Option("--max-query-chars", min=1, help="Longest query in characters; longer: 413 before any search (the search's time grows with a query's words and cannot be interrupted).")] = 4096,
    max_request_chars: Annotated[int, typer.Option("--max-request-chars", min=1, help="Most characters of all the queries of one request together; more: 413 before any search.")] = 1 << 20,
    max_topk: Annotated[int, typer.Option("--max-topk", min=1, help="Largest topk a request may ask for; topk must be an integer from 1 to this (else 400).")] = 100,
    max_hits: Annotated[int, typer.Option("--max-hits", min=1, help="Most hits per request (queries x topk), which bounds the reply's rows and the ranking's memory; more: 413.")] = 65536,
    max_reply_bytes: Annotated[int, typer.Option("--max-reply-bytes", min=1, help="Largest reply in bytes of JSON; a request whose reply would be larger gets 413.")] = 64 << 20,
    timeout_s: Annotated[float, typer.Option("--timeout", min=0.1, help="Seconds a connection has to send each request (from connect or the previous reply; idle connections are closed after it) and to take each reply; at most a week.")] = 10.0,
    max_connections: Annotated[int, typer.Option("--max-connections", min=1, help="Connections served at once; the next ones get 503 at once.")] = 64,
    workers: Annotated[int, typer.Option("--workers", min=1, max=64, help="Threads that search (the worker pool); each takes the waiting queries of every request (same topk) into one batched search, so one search runs while another's passages are fetched and encoded.")] = 2,
    max_batch: Annotated[int, typer.Option("--max-batch", min=1, help="Most queries in one batched search: waiting requests are taken together up to it; a larger request is searched in parts.")] = 1024,
    max_pending: Annotated[int, typer.Option("--max-pending", min=1, help="Most queries waiting to be searched, all requests together; a request that would pass it gets 429 (retry later) at once. A request arriving when nothing waits is always taken.")] = 16384,
    cache_mb: Annotated[int, typer.Option("--cache-mb", min=0, help="MiB of recent replies kept per (query, topk) in an LRU cache, so a repeated query is not searched again (0: no cache).")] = 64,
) -> None:
    """Serve the index with Search-R1's API: POST /retrieve {"queries", "topk", "return_scores"}; Ctrl-C stops.

    Every bound is an option (docs/reliability.md, "The retriever server's limits"); refusals are 4xx/503 with a
    JSON body {"error": "..."}.
    """
    from emapg_cli.retrieval import open_index
    from emapg_cli.retrieval.server import Limits, make_server

    if topk > max_topk:
        raise UserError(f"--topk {topk} is over --max-topk {max_topk}")
    check_seconds_option("--timeout", timeout_s)
    limits = Limits(max_body_bytes=max_body_bytes, max_queries=max_queries, max_query_chars=max_query_chars,
                    max_request_chars=max_request_chars, max_topk=max_topk, max_hits=max_hits,
                    max_reply_bytes=max_reply_bytes, timeout_s=timeout_s, max_connections=max_connections,
                    workers=workers, max_batch=max_batch, max_pending=max_pending, cache_mb=cache_mb)
    retriever = open_index(index_dir)  # bm25 or dense, as the manifest says
    try:
        server = make_server(retriever, host, port, default_topk=topk, rows=len(retriever.docs), limits=limits)
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    h, p = server.server_address[:2]
    console.print(f"serving {len(retriever.docs):,} documents at http://{h}:{p}/retrieve (Ctrl-C stops)", highlight=False)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
