"""The toy search task: a seeded world whose answers exist only in its corpus; gold episodes as the agent builds them."""

from __future__ import annotations

import pytest

from emapg_cli.tasks.toy_search.task import LINK_ATTR, POOL, VALUE_ATTRS, make_questions, make_world

SIZES = {"train": 30, "dev": 10, "test": 10}


def test_world_is_seeded_and_splits_are_disjoint():
    a, b = make_world(3, SIZES), make_world(3, SIZES)
    assert a == b and make_world(4, SIZES) != a
    sets = [set(v) for v in a.splits.values()]
    assert sum(map(len, sets)) == len(set.union(*sets)) == 50
    for split, entities in a.splits.items():  # bosses stay within the split: a test chain never touches train facts
        assert all(a.facts[e][LINK_ATTR] in entities and a.facts[e][LINK_ATTR] != e for e in entities)
    values = {a.facts[e][attr] for e in a.facts for attr in VALUE_ATTRS}
    assert values.isdisjoint(a.facts) and len(values) <= len(VALUE_ATTRS) * POOL
    # one passage per fact: 4 facts x 50 entities
    corpus = a.corpus()
    assert len(corpus) == 200 and corpus[0]["contents"].split("\n")[0] in a.facts


def test_questions_answers_and_gold_queries():
    w = make_world(0, SIZES)
    qs = make_questions(w, 0, "test", 40)
    assert len({q.question for q in qs}) == 40 and {q.meta["hops"] for q in qs} == {1, 2}
    assert all(q.meta["entity"] in w.splits["test"] for q in qs)
    for q in qs:
        e, attr = q.meta["entity"], q.meta["attr"]
        if q.meta["hops"] == 1:  # "city of Doka?" -> search "Doka city" -> the answer
            assert q.question == f"{attr} of {e}?" and q.meta["queries"] == [f"{e} {attr}"]
            assert q.answers == [w.facts[e][attr]]
        else:  # "city of boss of Doka?" -> "Doka boss" -> boss B -> "B city" -> the answer
            boss = w.facts[e][LINK_ATTR]
            assert q.meta["queries"] == [f"{e} {LINK_ATTR}", f"{boss} {attr}"] and q.answers == [w.facts[boss][attr]]
    # the answer of each question is written in its last gold passage, and in no question text
    passages = {d["id"]: d["contents"] for d in w.corpus()}
    for q in qs:
        entity, attr = q.meta["queries"][-1].split()
        assert passages[f"{entity}-{attr}"] == f"{entity}\n{entity} {attr} {q.answers[0]}"
        assert q.answers[0] not in q.question


def test_bm25_ranks_the_gold_passage_first_and_episodes_mask_observations(tmp_path):
    pytest.importorskip("bm25s")
    from emapg_cli.config import load_config
    from emapg_cli.data.schema import write_jsonl
    from emapg_cli.models.tiny import build_byte_tokenizer
    from emapg_cli.retrieval.bm25 import BM25Retriever, build_index
    from emapg_cli.tasks.toy_search.prepare import EpisodeEncoder, tokenizer_texts
    from emapg_cli.tasks.toy.sft import IGNORE

    w = make_world(0, SIZES)
    write_jsonl(tmp_path / "corpus.jsonl", w.corpus())
    build_index(tmp_path / "corpus.jsonl", tmp_path / "index")
    retriever = BM25Retriever.load(tmp_path / "index")
    qs = make_questions(w, 0, "train", 60)
    queries = [q for e in qs for q in e.meta["queries"]]
    hits = retriever.search(queries, 2)
    assert all(h[0].id == "-".join(q.split()) for q, h in zip(queries, hits))  # "Doka city" -> Doka-city first

    cfg = load_config("toy-search")
    tok = build_byte_tokenizer(corpus=tokenizer_texts(w, qs, retriever, cfg), vocab_size=400)
    names = set(w.facts)
    assert not any(t.lstrip("Ġ") in names for t in tok.get_vocab())  # names are never single tokens
    (tmp_path / "p.txt").write_text("{question}")
    cfg = cfg.model_copy(update={"search": cfg.search.model_copy(update={"prompt_template": str(tmp_path / "p.txt")})})
    enc = EpisodeEncoder(tok, retriever, cfg)
    ex = next(e for e in qs if e.meta["hops"] == 2)
    ids, labels = enc(ex.question, ex.meta["queries"], ex.answers[0])
    assert len(ids) == len(labels)
    trained = tok.decode([i for i, l in zip(ids, labels) if l != IGNORE])
    q1, q2 = ex.meta["queries"]
    assert trained == f"<search> {q1} </search><search> {q2} </search><answer> {ex.answers[0]} </answer>"
    assert "<information>" in tok.decode(ids) and tok.decode(ids).startswith(tok.decode(enc.prompt(ex.question)))


def test_prepare_runs_its_dev_checks_and_writes_a_warm_start(tmp_path):
    """`prepare_toy_search` end to end at a tiny scale: the dev checks run the real agent loop and the
    `em` reward on its completions (a merge once broke exactly this call), and the manifest records them."""
    pytest.importorskip("bm25s")
    from emapg_cli.tasks.toy_search import prepare as sp
    from emapg_cli.tasks.toy.sft import SFTConfig

    tiny = SFTConfig(hidden=16, layers=1, heads=2, kv_heads=1, max_steps=2, check_every=1, batch_size=2, warmup=1)
    sizes, counts = dict(sp.SIZES), (sp.N_TRAIN, sp.N_DEV, sp.N_TEST)
    try:
        sp.SIZES.update({"train": 20, "dev": 6, "test": 6})
        sp.N_TRAIN, sp.N_DEV, sp.N_TEST = 20, 4, 4
        sp.CHECK_SPARSE, sparse = 1, sp.CHECK_SPARSE
        m = sp.prepare_toy_search(tmp_path, seed=0, sft=tiny)
    finally:
        sp.SIZES.update(sizes)
        sp.N_TRAIN, sp.N_DEV, sp.N_TEST = counts
        sp.CHECK_SPARSE = sparse
    # one dev check per SFT step (check_every 1, sparse 1), each an accuracy over the 4 dev questions
    curve = m["sft_dev_accuracy"]
    assert [s for s, _ in curve] == [1, 2] and all(acc in (0, 0.25, 0.5, 0.75, 1.0) for _, acc in curve)
    assert 0.0 <= m["sft_test_accuracy"] <= 1.0 and m["sft_test_accuracy_no_search"] == 0.0
    assert (tmp_path / "toy-search" / "model" / "config.json").exists()
