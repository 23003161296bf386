"""Issue 20, "data loss" and "every reader one line": the index folder is claimed and validated, only what emapg
made is deleted, observations are cut by characters before tokenising, and status.json says how a run ended.
The CLI-level checks are the probes in tests/probes/index.py; these are the small in-process ones."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from emapg_cli.agents.episode import OBS_CHARS_PER_TOKEN, OBS_MIN_CHARS, add_observation, new_episode, observation_ids
from emapg_cli.errors import UserError

pytest.importorskip("bm25s")


def _corpus(path: Path, n: int = 4) -> Path:
    path.write_text("".join(json.dumps({"id": f"d{i}", "contents": f"Title {i}\nriver{i} flows past stone{i}"}) + "\n"
                            for i in range(n)))
    return path


# ------------------------------------------------------------------------------------------ observations
class CountingEncoder:
    """One id per character (a byte tokenizer on ASCII), recording the length of every text it was given."""

    def __init__(self):
        self.calls: list[int] = []

    def __call__(self, text: str) -> list[int]:
        self.calls.append(len(text))
        return [ord(c) for c in text]


def test_normal_observation_is_tokenised_whole():
    enc = CountingEncoder()
    text = "x" * 3000  # below OBS_MIN_CHARS = 4096: exactly as before
    assert observation_ids(enc, text, 500) == enc(text) and enc.calls == [3000, 3000]


def test_huge_observation_is_cut_by_characters_first():
    enc = CountingEncoder()
    text = "ab" * 5_000_000  # 10 M characters
    ids = observation_ids(enc, text, 500)
    # the prefix: max(4096, (500 + 1) x 8) = 4096 characters -> 4096 ids >= 501 + 16: the first 501 are kept
    assert OBS_MIN_CHARS == 4096 and OBS_CHARS_PER_TOKEN == 8 and enc.calls == [4096]
    assert ids == [ord(c) for c in text[:501]]
    ep = new_episode()
    add_observation(ep, ids, 500)
    assert len(ep.token_ids) == 500 and ep.obs_cut == 1  # one id more than kept: counted as cut, as before


def test_long_tokens_grow_the_prefix():
    """An encoder with 100 characters per token. Limit 20: 21 ids wanted, 21 + 16 = 37 needed; the 4096-character
    prefix gives 40: enough. Limit 100: 117 needed; 4096 -> 40 ids, then 4 x 4096 = 16384 -> 163 ids: enough."""
    calls = []

    def enc(text):
        calls.append(len(text))
        return [0] * (len(text) // 100)

    text = "y" * 1_000_000
    assert len(observation_ids(enc, text, 20)) == 21 and calls == [4096]  # 40 ids >= 21 + 16
    calls.clear()
    # limit 100: start max(4096, 101 x 8 = 808) = 4096 -> 40 ids; x4 = 16384 -> 163 ids >= 117: done
    assert len(observation_ids(enc, text, 100)) == 101 and calls == [4096, 16384]


# ------------------------------------------------------------------------------------------ the index
def test_build_keeps_a_users_tmp_folder_and_hashes_every_file(tmp_path):
    from emapg_cli.retrieval.bm25 import BM25Retriever, build_index
    from emapg_cli.fileio import sha256_file

    (tmp_path / "X.tmp").mkdir()
    (tmp_path / "X.tmp" / "thesis.txt").write_text("mine")
    manifest = build_index(_corpus(tmp_path / "c.jsonl"), tmp_path / "X")
    assert (tmp_path / "X.tmp" / "thesis.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["X", "X.tmp", "c.jsonl"]  # no temporary folder left
    assert manifest["files"]["docs.bin"]["sha256"] == sha256_file(tmp_path / "X" / "docs.bin")
    assert set(manifest["files"]) == {f"bm25/{p.name}" for p in (tmp_path / "X" / "bm25").iterdir()} | {"docs.bin", "docs.offsets.npy"}
    assert len(BM25Retriever.load(tmp_path / "X").docs) == 4
    with pytest.raises(UserError, match="already holds an index; choose a new --out folder"):
        build_index(tmp_path / "c.jsonl", tmp_path / "X")


def test_docs_shorter_than_the_model_is_refused(tmp_path):
    """The doc store one row short, with the manifest's rows and hashes made to agree: the model's 4 documents != 3."""
    from emapg_cli.retrieval.base import file_table
    from emapg_cli.retrieval.bm25 import BM25Retriever, build_index
    from emapg_cli.retrieval.docstore import write_docstore

    out = tmp_path / "X"
    build_index(_corpus(tmp_path / "c.jsonl"), out)
    lines = (out / "docs.bin").read_text().splitlines()
    write_docstore([json.loads(line) for line in lines[:3]], out)
    m = json.loads((out / "manifest.json").read_text())
    m.update(rows=3, files=file_table(out))
    m["files"] = {k: v for k, v in m["files"].items() if not k.startswith(".emapg")}
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(UserError, match=r"the bm25 model has 4 documents, docs.bin has 3"):
        BM25Retriever.load(out)


def test_stop_words_corpus_is_one_line(tmp_path):
    from emapg_cli.retrieval.bm25 import build_index

    path = tmp_path / "c.jsonl"
    path.write_text('{"id": "1", "contents": "The\\nthe of a"}\n')
    with pytest.raises(UserError, match="no row has a searchable word"):
        build_index(path, tmp_path / "X")
    assert not (tmp_path / "X").exists()


def test_remove_index_removes_only_an_index(tmp_path):
    from emapg_cli.retrieval.bm25 import build_index, remove_index

    build_index(_corpus(tmp_path / "c.jsonl"), tmp_path / "X")
    remove_index(tmp_path / "X")
    assert not (tmp_path / "X").exists()
    (tmp_path / "Y").mkdir()
    (tmp_path / "Y" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not an index emapg wrote"):
        remove_index(tmp_path / "Y")
    assert (tmp_path / "Y" / "notes.txt").read_text() == "mine"
    build_index(_corpus(tmp_path / "c.jsonl"), tmp_path / "Z")  # a link to a real index: refused, both kept
    (tmp_path / "link").symlink_to(tmp_path / "Z")
    with pytest.raises(UserError, match="symbolic link"):
        remove_index(tmp_path / "link")
    assert (tmp_path / "link").is_symlink() and (tmp_path / "Z" / "manifest.json").is_file()


# ------------------------------------------------------------------------------------------ deletions
def test_atomic_write_never_touches_a_fixed_tmp_name(tmp_path):
    from emapg_cli.paths import write_text_atomic

    (tmp_path / "summary.json.tmp").write_text("the user's")
    write_text_atomic(tmp_path / "summary.json", "{}")
    assert (tmp_path / "summary.json.tmp").read_text() == "the user's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json", "summary.json.tmp"]


def test_ablate_removes_only_an_emapg_train_folder(tmp_path):
    from emapg_cli.ablate.runner import launch_args, run_dir
    from emapg_cli.ablate.study import Sweep

    spec = SimpleNamespace(config_id="c0", seed=1, overrides=[], run_id="c0/seed1")
    sweep = SimpleNamespace(preset=None, config=None)
    sweep.command = lambda verb, sets: Sweep.command(sweep, verb, sets)  # the sweep's command lines, as a Sweep builds them
    rdir = run_dir(tmp_path, spec)
    rdir.mkdir(parents=True)
    (rdir / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="was not written by `emapg train`"):
        launch_args(sweep, spec, tmp_path)
    assert (rdir / "notes.txt").is_file()
    (rdir / ".emapg.json").write_text(json.dumps({"command": "train"}))  # a failed attempt of the sweep: restarted
    assert launch_args(sweep, spec, tmp_path)[0] == "train" and not rdir.exists()


def test_failed_claim_removes_a_created_parent_only_when_empty(tmp_path):
    """`--out runs/a` creates runs/ and runs/a; meanwhile another command put runs/b there: a failure removes
    runs/a but not runs/ (it used to rmtree the outermost folder it created, runs/, with runs/b in it)."""
    from emapg_cli.outputs import claim_folder

    with pytest.raises(UserError), claim_folder(tmp_path / "runs" / "a", "eval"):
        (tmp_path / "runs" / "b").mkdir()
        (tmp_path / "runs" / "b" / "metrics.jsonl").write_text("{}\n")
        raise UserError("bad input")
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["b"]
    with pytest.raises(UserError), claim_folder(tmp_path / "new" / "deep", "eval"):
        raise UserError("bad input")
    assert not (tmp_path / "new").exists()  # empty parents it made go too


# ------------------------------------------------------------------------------------------ status.json
def test_status_running_done_failed_stopped(tmp_path):
    from emapg_cli.train.status import tracked

    def status():
        return json.loads((tmp_path / "status.json").read_text())

    with pytest.raises(UserError), tracked(tmp_path, lambda: 0):
        raise UserError("no intact checkpoint")  # refused before the run started: nothing written
    assert not (tmp_path / "status.json").exists()
    step = [0]
    with tracked(tmp_path, lambda: step[0]) as start:
        start()
        assert status()["status"] == "running"
        step[0] = 3
    assert (status()["status"], status()["step"], status()["reason"]) == ("done", 3, "")
    with pytest.raises(UserError), tracked(tmp_path, lambda: 2) as start:
        start()
        raise UserError("step 2: the retriever is down")
    assert (status()["status"], status()["step"], status()["reason"]) == ("failed", 2, "step 2: the retriever is down")
    with pytest.raises(KeyboardInterrupt), tracked(tmp_path, lambda: 1) as start:
        start()
        raise KeyboardInterrupt
    assert (status()["status"], status()["reason"]) == ("stopped", "stopped by SIGINT (Ctrl-C)")
    with pytest.raises(RuntimeError), tracked(tmp_path, lambda: 1) as start:
        start()
        raise RuntimeError("boom\nsecond line")
    assert status()["reason"] == "RuntimeError: boom"
