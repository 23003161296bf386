"""The retriever index on disk, output folders that are never someone else's, passages cut before tokenising,
and what a failed training run keeps (docs/reliability.md "Output folders", "What a failed run keeps";
docs/search.md "Index validation")."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from . import probe
from .common import base_env, emapg, ok, one_line_error

CORPUS_A = [{"id": f"a{i}", "contents": f"Alpha {i}\nthe alpha river number {i} flows north past stone{i}"} for i in range(6)]
CORPUS_B = [{"id": f"b{i}", "contents": f"Beta {i}\nthe beta mountain number {i} rises over forest{i}"} for i in range(9)]


def _jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _index(ws: Path, rows=CORPUS_A, name: str = "idx") -> Path:
    corpus = _jsonl(ws / f"{name}.jsonl", rows)
    ok(emapg(ws, "retriever", "index", str(corpus), "--out", name))
    return ws / name


def _python(ws: Path, code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -c CODE` with this checkout first on the path (what the probes' CLI runs)."""
    return subprocess.run([sys.executable, "-c", code], cwd=ws, capture_output=True, text=True, timeout=timeout,
                          env=base_env(ws))


# ------------------------------------------------------------------------------------------- data loss
@probe("index_keeps_a_users_tmp_folder")
def index_keeps_a_users_tmp_folder(ws: Path) -> None:
    """The user has X.tmp/thesis.txt beside the new index X: `retriever index --out X` must not touch it
    (it used to rmtree a fixed X.tmp), and leaves no temporary folder; --out Y, a folder of the user's with
    files, is refused with one line and left as it is."""
    (ws / "X.tmp").mkdir()
    (ws / "X.tmp" / "thesis.txt").write_text("four years of work\n")
    corpus = _jsonl(ws / "c.jsonl", CORPUS_A)
    ok(emapg(ws, "retriever", "index", str(corpus), "--out", "X"))
    assert (ws / "X.tmp" / "thesis.txt").read_text() == "four years of work\n", "X.tmp/thesis.txt was deleted or changed"
    assert (ws / "X" / "manifest.json").is_file(), "no index written"
    left = sorted(p.name for p in ws.iterdir() if p.name not in ("X", "X.tmp", "c.jsonl", "home"))
    assert not left, f"temporary folders left behind: {left}"
    (ws / "Y").mkdir()  # and a folder of the user's with files is refused, unchanged
    (ws / "Y" / "notes.txt").write_text("mine\n")
    one_line_error(emapg(ws, "retriever", "index", str(corpus), "--out", "Y"), "Y")
    assert sorted(p.name for p in (ws / "Y").iterdir()) == ["notes.txt"], "the user's folder Y changed"


@probe("index_concurrent_same_out")
def index_concurrent_same_out(ws: Path) -> None:
    """Two `retriever index` runs on one --out at once (corpora A and B): one exits 2 "in use" (or "already holds"
    once the other finished), the other's index is its own corpus, and the manifest matches the documents."""
    big_a = [{"id": f"a{i}", "contents": f"Alpha {i}\n" + f"alpha river {i} " * 40} for i in range(4000)]
    big_b = [{"id": f"b{i}", "contents": f"Beta {i}\n" + f"beta mountain {i} " * 40} for i in range(4000)]
    for rows, name in ((big_a, "A"), (big_b, "B")):
        _jsonl(ws / f"{name}.jsonl", rows)
    env = base_env(ws)
    procs = {name: subprocess.Popen([sys.executable, "-m", "emapg_cli", "retriever", "index", f"{name}.jsonl", "--out", "X"],
                                    cwd=ws, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name in ("A", "B")}
    results = {name: (p.wait(timeout=180), p.stderr.read()) for name, p in procs.items()}
    winners = [n for n, (code, _) in results.items() if code == 0]
    assert len(winners) == 1, f"expected exactly one success: {results}"
    loser = "B" if winners == ["A"] else "A"
    code, err = results[loser]
    assert code == 2 and "Traceback" not in err and ("in use" in err or "already holds" in err), f"loser: exit {code} {err!r}"
    manifest = json.loads((ws / "X" / "manifest.json").read_text())
    docs = [json.loads(line) for line in (ws / "X" / "docs.bin").read_text().splitlines()]
    assert manifest["corpus"] == f"{winners[0]}.jsonl", f"manifest names {manifest['corpus']}, {winners[0]} won"
    assert {d["id"][0] for d in docs} == {winners[0].lower()}, "docs.bin holds the other run's corpus"
    r = ok(emapg(ws, "retriever", "query", "X", "beta mountain" if winners == ["B"] else "alpha river", "--json"))
    assert json.loads(r.out)[0]["id"][0] == winners[0].lower(), "the index answers with the other corpus"


@probe("index_stop_words_corpus")
def index_stop_words_corpus(ws: Path) -> None:
    """A corpus whose every word is a stop word: one line at index time (was a ValueError traceback), no folder made."""
    corpus = _jsonl(ws / "c.jsonl", [{"id": "1", "contents": "The\nthe a an of"}, {"id": "2", "contents": "It\nit is, was."}])
    one_line_error(emapg(ws, "retriever", "index", str(corpus), "--out", "X"), "c.jsonl", "stop word")
    assert not (ws / "X").exists(), "a half-made index folder was left"


# ------------------------------------------------------------------------------------ tampered indexes
def _rewrite_manifest(folder: Path, fn) -> None:
    m = json.loads((folder / "manifest.json").read_text())
    m = fn(m)
    (folder / "manifest.json").write_text(json.dumps(m) if not isinstance(m, str) else m)


def _rehash(folder: Path, m: dict) -> dict:
    """The manifest with `files` recomputed (a tampering that keeps the hashes consistent)."""
    import hashlib

    m["files"] = {p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
                  for p in sorted(folder.rglob("*")) if p.is_file() and p.name not in ("manifest.json", ".emapg.json", ".emapg.lock")}
    return m


def _drop_last_doc(folder: Path) -> None:
    """The doc store one row shorter than the bm25 model, the manifest's rows and hashes made to agree with it."""
    from emapg_cli.retrieval.docstore import write_docstore

    write_docstore([json.loads(line) for line in (folder / "docs.bin").read_text().splitlines()][:-1], folder)
    _rewrite_manifest(folder, lambda m: _rehash(folder, {**m, "rows": m["rows"] - 1}))


def _legacy_short_docs(folder: Path) -> None:
    """The folder made a format /1 one (docs.jsonl, no file hashes, a format no longer read) whose docs.jsonl is one
    row shorter than the model."""
    lines = (folder / "docs.bin").read_text().splitlines(keepends=True)
    (folder / "docs.jsonl").write_text("".join(lines[:-1]))
    (folder / "docs.bin").unlink()
    (folder / "docs.offsets.npy").unlink()
    _rewrite_manifest(folder, lambda m: {**{k: v for k, v in m.items() if k != "files"}, "format": "emapg-bm25/1", "rows": m["rows"] - 1})


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _garble(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 3, len(data) // 3 + 8):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


#: name -> tampering of an index folder (each must be refused with one line naming the folder).
TAMPER = {
    "manifest_deleted": lambda f: (f / "manifest.json").unlink(),
    "manifest_truncated": lambda f: _truncate(f / "manifest.json"),
    "manifest_garbled": lambda f: (f / "manifest.json").write_bytes(b"\xff\xfe{\x00garbage"),
    "manifest_a_list": lambda f: _rewrite_manifest(f, lambda m: [m]),
    "manifest_rows_string": lambda f: _rewrite_manifest(f, lambda m: {**m, "rows": str(m["rows"])}),
    "manifest_rows_bool": lambda f: _rewrite_manifest(f, lambda m: {**m, "rows": True}),
    "manifest_rows_wrong": lambda f: _rewrite_manifest(f, lambda m: {**m, "rows": m["rows"] + 3}),
    "manifest_rows_negative": lambda f: _rewrite_manifest(f, lambda m: {**m, "rows": -1}),
    "manifest_missing_key": lambda f: _rewrite_manifest(f, lambda m: {k: v for k, v in m.items() if k != "corpus_sha256"}),
    "manifest_extra_key": lambda f: _rewrite_manifest(f, lambda m: {**m, "surprise": 1}),
    "manifest_wrong_format": lambda f: _rewrite_manifest(f, lambda m: {**m, "format": "emapg-bm25/99"}),
    "manifest_files_wrong_type": lambda f: _rewrite_manifest(f, lambda m: {**m, "files": {k: {"bytes": "1", "sha256": v["sha256"]}
                                                                                         for k, v in m.get("files", {"docs.jsonl": {"sha256": ""}}).items()}}),
    "manifest_files_outside": lambda f: _rewrite_manifest(f, lambda m: {**m, "files": {**m.get("files", {}), "../x": {"bytes": 1, "sha256": "0"}}}),
    "docs_deleted": lambda f: (f / "docs.bin").unlink(),
    "docs_truncated": lambda f: _truncate(f / "docs.bin"),
    "docs_garbled": lambda f: _garble(f / "docs.bin"),
    "docs_shorter_than_model": _drop_last_doc,
    "docs_wrong_row_type": lambda f: ((f / "docs.bin").write_text("[1, 2]\n" * len((f / "docs.bin").read_text().splitlines())),
                                      _rewrite_manifest(f, lambda m: _rehash(f, m))),
    "model_params_deleted": lambda f: (f / "bm25" / "params.index.json").unlink(),
    "model_data_truncated": lambda f: _truncate(f / "bm25" / "data.csc.index.npy"),
    "model_vocab_garbled": lambda f: _garble(f / "bm25" / "vocab.index.json"),
    "model_indptr_garbled_rehashed": lambda f: (_garble(f / "bm25" / "indptr.csc.index.npy"), _rewrite_manifest(f, lambda m: _rehash(f, m))),
    "model_params_num_docs_rehashed": lambda f: ((f / "bm25" / "params.index.json").write_text(
        (f / "bm25" / "params.index.json").read_text().replace('"num_docs": 6', '"num_docs": 60')), _rewrite_manifest(f, lambda m: _rehash(f, m))),
    "extra_file": lambda f: (f / "bm25" / "planted.npy").write_bytes(b"x"),
    "folder_is_a_file": lambda f: (__import__("shutil").rmtree(f), f.write_text("not a folder")),
    "legacy_format_short_docs": _legacy_short_docs,
}


@probe("index_tampered_variants")
def index_tampered_variants(ws: Path) -> None:
    """26 tamperings of an index (each file deleted, truncated or garbled; wrong counts, wrong JSON types, missing
    and unknown manifest keys, a docs file shorter than the model, a planted file): loading it (what `retriever
    query|serve`, `eval --retriever` and training's search.index do) is one UserError line naming the index folder,
    for every one (it used to crash, or answer from a broken index). Loaded in one process, for speed; the CLI's
    exit 2 for such a line is `index_tampered_cli`."""
    import shutil

    good = _index(ws)
    for name, tamper in TAMPER.items():
        folder = ws / f"t_{name}"
        shutil.copytree(good, folder)
        tamper(folder)
    code = r'''
import json, sys
from emapg_cli.errors import UserError
from emapg_cli.retrieval.bm25 import BM25Retriever
out = {}
for name in json.loads(sys.argv[1]):
    try:
        BM25Retriever.load(f"t_{name}")
        out[name] = "loaded"
    except UserError as e:
        out[name] = "ok" if "\n" not in str(e) and f"t_{name}" in str(e) else f"bad message {str(e)[:150]!r}"
    except BaseException as e:
        out[name] = f"{type(e).__name__}: {str(e)[:150]}"
print(json.dumps(out))
'''
    r = subprocess.run([sys.executable, "-c", code, json.dumps(list(TAMPER))], cwd=ws, capture_output=True, text=True,
                       timeout=120, env=base_env(ws))
    assert r.returncode == 0, f"the loader crashed: {r.stderr.strip()[-400:]}"
    results = json.loads(r.stdout.strip().splitlines()[-1])
    failed = [f"{k}: {v}" for k, v in results.items() if v != "ok"]
    assert not failed, f"{len(failed)}/{len(TAMPER)} variants not refused as one line: " + " | ".join(failed)


@probe("index_tampered_cli")
def index_tampered_cli(ws: Path) -> None:
    """Tampered indexes through the CLI: `retriever query` (a docs file shorter than the model: it used to drop
    every connection of `serve`) and `retriever serve` (a garbled model file) exit 2 with one line naming the
    index, before any port opens."""
    import shutil

    good = _index(ws)
    shutil.copytree(good, ws / "short")
    _drop_last_doc(ws / "short")
    one_line_error(emapg(ws, "retriever", "query", "short", "alpha river"), "short", "docs.bin")
    shutil.copytree(good, ws / "garbled")
    _garble(ws / "garbled" / "bm25" / "data.csc.index.npy")
    one_line_error(emapg(ws, "retriever", "serve", "garbled", "--port", "0", timeout=30), "garbled", "data.csc.index.npy")


# ------------------------------------------------------------------------------------ huge passages
@probe("huge_passage_cut_before_tokenising")
def huge_passage_cut_before_tokenising(ws: Path) -> None:
    """A retriever returns a 20 MB passage: the search agent's observation is built in well under 2 s (it used to
    tokenise the whole passage before cutting it to search.max_obs_tokens: minutes, or killed), and is the same as
    the observation of the passage's first 100 KB."""
    code = r'''
import time
from emapg_cli.agents import SearchAgent
from emapg_cli.agents.episode import new_episode, EpisodeState
from emapg_cli.agents import protocol
from emapg_cli.config.models import SearchConfig
from emapg_cli.models.tiny import build_byte_tokenizer
from emapg_cli.retrieval.base import Hit
tok = build_byte_tokenizer()
s = SearchConfig(enabled=True, max_obs_tokens=500, max_context_tokens=4096, topk=1)
agent = SearchAgent(tok, None, s, max_turns=2)
def observe(text):
    st = EpisodeState(prompt=[1, 2, 3], episode=new_episode())
    t0 = time.perf_counter()
    agent._observe(st, protocol.information([Hit("1", "Huge", "Huge\n" + text, 1.0)]))
    return st.episode, time.perf_counter() - t0
body = "word " * 4_000_000
huge, seconds = observe(body)
small, _ = observe(body[:100_000])
assert huge.token_ids == small.token_ids and len(huge.token_ids) == 500 and huge.obs_cut == 1, "different observation"
print(f"{seconds:.3f}")
'''
    r = _python(ws, code, timeout=120)
    assert r.returncode == 0, f"failed: {r.stderr.strip()[-500:]}"
    seconds = float(r.stdout.strip().splitlines()[-1])
    assert seconds < 2.0, f"a 20 MB passage took {seconds:.1f} s to become an observation"


# ------------------------------------------------------------------------------- a failed training run
def _tiny_run_inputs(ws: Path) -> list[str]:
    r = _python(ws, "from emapg_cli.models.tiny import save_tiny; save_tiny('model', arch='qwen2')")
    assert r.returncode == 0, f"tiny model: {r.stderr[-300:]}"
    _jsonl(ws / "d.jsonl", [{"id": f"q{i}", "question": f"{i % 7}+{i % 5}", "answer": str(i % 7 + i % 5)} for i in range(8)])
    opts = {"model.path": "model", "data.train": "d.jsonl", "rollout.reward": "exact_match", "rollout.prompts_per_step": 2,
            "rollout.n": 2, "rollout.max_new_tokens": 4, "reward.truncated": "grade", "train.mini_batch_prompts": 2,
            "train.micro_batch_size": 4, "train.steps": 4}
    return [a for k, v in opts.items() for a in ("--set", f"{k}={v}")]


@probe("failed_run_keeps_its_folder", slow=True)
def failed_run_keeps_its_folder(ws: Path) -> None:
    """A run that stops at step 2 (lr 1e30: step 1's update makes the next losses non-finite, the skipped-steps
    guard stops it; save_every=0, so no checkpoint): the run folder stays with metrics.jsonl (steps 0-2) and
    status.json {"status": "failed", "reason": the error line, "step": 2}; the error names a metrics file that
    exists (it used to delete the folder, then say "see metrics.jsonl"). `--resume` then starts it over in the
    same folder and finishes it (status "done")."""
    opts = _tiny_run_inputs(ws)
    r = emapg(ws, "train", *opts, "--set", "optim.lr=1e30", "--set", "train.skip_window=1", "--out", "run", timeout=180)
    line = one_line_error(r, "step 2")
    run = ws / "run"
    assert (run / "metrics.jsonl").is_file(), f"metrics.jsonl is gone (folder: {sorted(p.name for p in run.iterdir()) if run.exists() else 'deleted'})"
    named = [w.rstrip(",;") for w in line.split() if w.rstrip(",;").endswith("metrics.jsonl")]
    assert named and all((ws / w).is_file() for w in named), f"the error names no existing metrics file: {line!r}"
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2], f"metrics steps {steps}"
    status = json.loads((run / "status.json").read_text())
    assert status["status"] == "failed" and status["step"] == 2 and status["reason"] == line[len("error: "):], f"status {status}"
    ok(emapg(ws, "train", "--resume", "run", "--set", "train.steps=2", "--set", "optim.lr=0.01", timeout=180))
    status = json.loads((run / "status.json").read_text())
    assert status["status"] == "done" and status["step"] == 2, f"status after --resume {status}"
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2], f"metrics steps after --resume {steps}"


@probe("stopped_run_says_stopped", slow=True)
def stopped_run_says_stopped(ws: Path) -> None:
    """SIGTERM during training (no checkpoint yet): the folder stays, status.json says "stopped" with the signal."""
    import signal

    opts = _tiny_run_inputs(ws)
    p = subprocess.Popen([sys.executable, "-m", "emapg_cli", "train", *opts, "--set", "train.steps=100000", "--out", "run"],
                         cwd=ws, env=base_env(ws), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = ws / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
        time.sleep(0.2)
    assert metrics.is_file(), "the run never logged a step"
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=60)
    status = json.loads((ws / "run" / "status.json").read_text())
    assert status["status"] == "stopped" and "SIGTERM" in status["reason"] and status["step"] >= 1, f"status {status}"
    assert metrics.is_file(), "metrics.jsonl is gone"
