"""`emapg eval --retriever`: the search agent's loop as an evaluation, end to end, resumable."""

from __future__ import annotations

import json

import pytest
from eval_helpers import rerun_after_torn_write

from emapg_cli.datasets.loading import load_examples
from emapg_cli.datasets.prepare import prepare_dataset
from emapg_cli.errors import UserError
from emapg_cli.evaluation.search import parse_retriever, search_summary


def test_parse_retriever():
    assert parse_retriever("bm25:/x/idx") == {"retriever": "bm25", "index": "/x/idx"}
    assert parse_retriever("http://127.0.0.1:8000") == {"retriever": "http", "url": "http://127.0.0.1:8000/retrieve"}
    assert parse_retriever("http://h:1/retrieve") == {"retriever": "http", "url": "http://h:1/retrieve"}
    assert parse_retriever("http://h:1,http://g:2/retrieve") == {"retriever": "http", "url": ["http://h:1/retrieve", "http://g:2/retrieve"]}
    for bad in ("bm25:", "faiss:/x", "127.0.0.1:8000", "http://h:1,notaurl", "http://h:1,"):
        with pytest.raises(UserError, match="--retriever"):
            parse_retriever(bad)


def test_search_summary_by_hand():
    from emapg_cli.data.schema import Example

    exs = [Example(id="a", question="q?", answers=["Paris"], source="nq"),
           Example(id="b", question="q?", answers=["the big apple"], source="hotpotqa")]
    traj = lambda s, i, t, o: {"searches": s, "invalid": i, "turns": t, "outcome": o}  # noqa: E731
    rows = {"a": {"extracted": ["paris", None], "trajectories": [traj(1, 0, 2, "answer"), traj(2, 1, 5, "no_answer")]},
            "b": {"extracted": ["big apple city", "Big Apple"], "trajectories": [traj(0, 0, 1, "answer"), traj(1, 0, 2, "answer")]}}
    s = search_summary(exs, rows)
    # EM: a = (1, 0), b = (0, 1) -> 2/4. F1: "big apple city" vs "big apple": P 2/3, R 1 -> 0.8; so (1 + 0 + 0.8 + 1)/4 = 0.7
    assert s["exact_match"] == pytest.approx(0.5) and s["f1"] == pytest.approx(0.7)
    # searches (1 + 2 + 0 + 1)/4 = 1; invalid 1 of 10 turns; turns 10/4; answered 3/4
    assert (s["searches_per_question"], s["invalid_action_rate"], s["turns"], s["answered"]) == (1.0, 0.1, 2.5, 0.75)
    assert s["sources"]["nq"]["exact_match"] == 0.5 and s["sources"]["hotpotqa"]["f1"] == pytest.approx(0.9)


CORPUS = [
    {"id": "d1", "contents": "\"Paris\"\nParis is the capital of France."},
    {"id": "d2", "contents": "\"Berlin\"\nBerlin is the capital of Germany."},
    {"id": "d3", "contents": "\"Apple\"\nThe apple is a fruit."},
]


@pytest.fixture
def search_bench(tmp_path, emapg_home, cli):
    """A prepared two-source QA bench and a BM25 index of a three-passage corpus."""
    rows = [{"id": f"q{i}", "question": q, "golden_answers": a, "data_source": src}
            for i, (q, a, src) in enumerate([("capital of france", ["Paris"], "nq"), ("capital of germany", ["Berlin"], "nq"),
                                             ("what fruit", ["apple"], "hotpotqa"), ("capital of spain", ["Madrid"], "hotpotqa")])]
    (tmp_path / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepare_dataset("nq", from_file=tmp_path / "qa.jsonl", out=tmp_path / "qa")  # a QA card: data_source kept
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in CORPUS))
    r = cli("retriever", "index", str(tmp_path / "corpus.jsonl"), "--out", str(tmp_path / "index"))
    assert r.returncode == 0, r.stderr
    return tmp_path / "qa", tmp_path / "index"


def test_eval_with_bm25_end_to_end_and_resume(search_bench, tiny_llama, tmp_path, cli):
    bench, index = search_bench
    out = tmp_path / "run"
    common = ["eval", "--bench", str(bench), "--model", str(tiny_llama), "--backend", "hf", "--retriever", f"bm25:{index}",
              "--max-turns", "2", "--max-tokens", "12", "--chunk", "1", "--out", str(out)]
    r = cli(*common, "--limit", "2")
    assert r.returncode == 0, r.stderr
    first = (out / "results.jsonl").read_text().splitlines()
    row = json.loads(first[0])
    (t,) = row["trajectories"]  # greedy, one sample per question by default
    assert set(t) == {"queries", "retrieved_ids", "answer", "outcome", "turns", "searches", "invalid", "text"}
    assert len(t["queries"]) == len(t["retrieved_ids"]) == t["searches"] and 1 <= t["turns"] <= 3
    run = json.loads((out / "run.json").read_text())
    assert (run["n"], run["temperature"], run["reward"], run["max_tokens"]) == (1, 0.0, "em", 12)

    # interrupted mid-write: the rerun keeps the finished rows byte for byte and runs only the new items
    summary = rerun_after_torn_write(cli, common, out, first, '{"id": "q2", "respon')
    lines = (out / "results.jsonl").read_text().splitlines()
    assert summary["sampling"]["retriever"] == f"bm25:{index}"
    s = summary["search"]
    assert {"exact_match", "f1", "searches_per_question", "invalid_action_rate", "turns"} <= set(s)
    assert set(s["sources"]) == {"nq", "hotpotqa"} and s["sources"]["nq"]["num_items"] == 2
    assert "searches/q" in (out / "summary.md").read_text()

    # a finished run reruns without generating anything
    r = cli(*common, "--limit", "4")
    assert r.returncode == 0, r.stderr
    again = json.loads((out / "summary.json").read_text())
    assert again["resumed_items"] == 4 and again["generated_tokens"] == 0 and again["search"] == s
    assert (out / "results.jsonl").read_text().splitlines() == lines

    # other search settings in the same folder would mix results
    r = cli(*common[:-2], "--topk", "2", "--out", str(out), "--limit", "4")
    assert r.returncode == 2 and "other settings" in r.stderr


def test_eval_search_errors(search_bench, tiny_llama, tmp_path, cli_many):
    bench, index = search_bench
    base = ["eval", "--bench", str(bench), "--model", str(tiny_llama), "--backend", "hf", "--out", str(tmp_path / "e")]
    faiss, math, missing = cli_many((*base, "--retriever", "faiss:/x"),  # independent refusals, two at a time
                                    (*base, "--retriever", f"bm25:{index}", "--reward", "math"),
                                    (*base, "--retriever", f"bm25:{tmp_path / 'missing'}"))
    assert faiss.returncode == 2 and "--retriever must be" in faiss.stderr
    assert math.returncode == 2 and "--reward em or f1" in math.stderr
    assert missing.returncode == 2 and "error" in missing.stderr


def test_eval_shared_benches_with_a_hotpotqa_index(shared_data, tiny_llama, tmp_path, emapg_home, cli, cli_many):
    # the real files: Bamboogle and HotpotQA prepared from the shared copies, one BM25 index of HotpotQA's paragraphs
    src = shared_data / "search"
    benches = (("bamboogle", "bamboogle_test.jsonl"), ("hotpotqa", "hotpotqa_dev_ircot500.jsonl"))
    corpus, *prepared = cli_many(  # independent preparations, two at a time
        ("prepare", "hotpotqa-corpus", "--from", str(src / "hotpotqa_dev_ircot500.jsonl"), "--out", str(tmp_path / "corpus")),
        *(("prepare", name, "--from", str(src / file)) for name, file in benches))
    assert corpus.returncode == 0, corpus.stderr
    assert all(r.returncode == 0 for r in prepared), [r.stderr for r in prepared]
    r = cli("retriever", "index", str(tmp_path / "corpus" / "corpus.jsonl"), "--out", str(tmp_path / "index"))
    assert r.returncode == 0, r.stderr
    evals = cli_many(*(("eval", "--bench", name, "--model", str(tiny_llama), "--backend", "hf", "--retriever",
                        f"bm25:{tmp_path / 'index'}", "--max-turns", "1", "--max-tokens", "8", "--limit", "3",
                        "--out", str(tmp_path / f"run-{name}")) for name, _ in benches))
    for (name, _), r in zip(benches, evals):
        out = tmp_path / f"run-{name}"
        assert r.returncode == 0, r.stderr
        rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
        assert [x["id"] for x in rows] == [e.id for e in load_examples(name)[:3]]
        assert json.loads((out / "summary.json").read_text())["search"]["num_items"] == 3
