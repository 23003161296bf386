"""`emapg prepare` for the seven search QA datasets: every published layout, every gold alias kept."""

from __future__ import annotations

import json

import pytest

from emapg_cli.datasets.loading import load_examples
from emapg_cli.datasets import get_spec
from emapg_cli.datasets.convert import convert_row
from emapg_cli.datasets.rows import RowError
from emapg_cli.datasets.prepare import prepare_dataset

SEARCH = ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")


def test_registry_names_the_flashrag_sources():
    # Search-R1's test parquet: FlashRAG `test` when present, else `dev`; counts from FlashRAG's table.
    expected = {"nq": ("test", 3610), "triviaqa": ("test", 11313), "popqa": ("test", 14267), "hotpotqa": ("dev", 7405),
                "2wikimultihopqa": ("dev", 12576), "musique": ("dev", 2417), "bamboogle": ("test", 125)}
    for name in SEARCH:
        s = get_spec(name)
        assert (s.hub_id, s.config, s.answer_format, s.role) == ("RUC-NLPIR/FlashRAG_datasets", name, "qa_aliases", "eval")
        assert (s.split, s.expected_rows) == expected[name]
    assert sum(n for _, n in expected.values()) == 51713  # the merged test parquet's size
    assert get_spec("nq_hotpotqa_train").hub_id == "PeterJinGo/nq_hotpotqa_train"


# Hand-written rows in each published layout (fields as the datasets' own files spell them).
TWOWIKI_NATIVE = {  # 2WikiMultihopQA dev.json
    "_id": "8813f87c0bdd11eba7f7acde48001122", "type": "compositional",
    "question": "Who is the mother of the director of film Polish-Russian War (Film)?",
    "context": [["Xawery Żuławski", ["Xawery Żuławski (born 22 December 1971 in Warsaw) is a Polish film director."]],
                ["Polish-Russian War (film)", ["Polish-Russian War is a 2009 Polish film directed by Xawery Żuławski."]]],
    "supporting_facts": [["Polish-Russian War (film)", 0], ["Xawery Żuławski", 0]],
    "evidences": [["Polish-Russian War", "director", "Xawery Żuławski"]],
    "answer": "Małgorzata Braunek",
}
MUSIQUE_NATIVE = {  # musique_full_v1.0_dev.jsonl
    "id": "2hop__460946_294723", "question": "Who is the spouse of the Green performer?",
    "paragraphs": [{"idx": 0, "title": "Green (Steve Hillage album)", "paragraph_text": "Green is by Steve Hillage.", "is_supporting": True},
                   {"idx": 1, "title": "Miquette Giraudy", "paragraph_text": "Miquette Giraudy is Hillage's partner.", "is_supporting": True},
                   {"idx": 2, "title": "Green", "paragraph_text": "Green is a colour.", "is_supporting": False}],
    "question_decomposition": [{"id": 460946, "question": "Green >> performer", "answer": "Steve Hillage", "paragraph_support_idx": 0}],
    "answer": "Miquette Giraudy", "answer_aliases": ["M. Giraudy", "Miquette Giraudy"], "answerable": True,
}
IRCOT_2WIKI = {  # IRCoT's processed_data/2wikimultihopqa
    "question_id": "5811079c0bdc11eba7f7acde48001122", "question_text": "Which film came out first, Blind Shaft or The Mask Of Fu Manchu?",
    "answers_objects": [{"number": "", "date": {"day": "", "month": "", "year": ""}, "spans": ["The Mask Of Fu Manchu"]}],
    "contexts": [{"id": "0", "title": "Blind Shaft", "paragraph_text": "Blind Shaft is a 2003 film.", "is_supporting": True}],
}


@pytest.mark.parametrize(
    "row, name, expected",
    [
        (TWOWIKI_NATIVE, "2wikimultihopqa",
         {"id": "8813f87c0bdd11eba7f7acde48001122", "answers": ["Małgorzata Braunek"], "source": "2wikimultihopqa",
          "meta": {"type": "compositional", "subset": "compositional",
                   "supporting_titles": ["Polish-Russian War (film)", "Xawery Żuławski"]}}),
        # answer + aliases, the repeated alias once; the hop count is in the id
        (MUSIQUE_NATIVE, "musique",
         {"id": "2hop__460946_294723", "answers": ["Miquette Giraudy", "M. Giraudy"], "source": "musique",
          "meta": {"answerable": True, "supporting_titles": ["Green (Steve Hillage album)", "Miquette Giraudy"]}}),
        (IRCOT_2WIKI, "2wikimultihopqa",
         {"id": "5811079c0bdc11eba7f7acde48001122", "answers": ["The Mask Of Fu Manchu"], "source": "2wikimultihopqa",
          "meta": {"supporting_titles": ["Blind Shaft"]}}),
        # FlashRAG layout: golden_answers; the nested metadata dict is not kept
        ({"id": "test_1", "question": "Who?", "golden_answers": ["A", "B"], "metadata": {"x": 1}}, "nq",
         {"id": "test_1", "answers": ["A", "B"], "source": "nq", "meta": {}}),
        # PopQA's original layout: possible_answers is a JSON-encoded string
        ({"id": 7, "question": "Who?", "possible_answers": "[\"Ralph Rainger\", \"Ralph Reichenthal\"]", "prop": "composer"}, "popqa",
         {"id": "7", "answers": ["Ralph Rainger", "Ralph Reichenthal"], "source": "popqa", "meta": {"prop": "composer"}}),
        # IRCoT numbers count as answers next to spans
        ({"question_id": "q", "question_text": "How many?", "answers_objects": [{"number": "3", "spans": []}]}, "musique",
         {"id": "q", "answers": ["3"], "source": "musique", "meta": {}}),
    ],
)
def test_published_layouts(row, name, expected):
    out = convert_row(row, 0, get_spec(name))
    assert out["question"] == (row.get("question") or row["question_text"])
    assert {k: out[k] for k in expected} == expected


def test_search_r1_parquet_layouts():
    spec = get_spec("nq_hotpotqa_train")
    prompt = [{"role": "user", "content": "Answer the given question. ... For example, <answer> Beijing </answer>. Question: who wrote hamlet?\n"}]
    full = {"id": "train_0", "question": "who wrote hamlet", "golden_answers": ["Shakespeare", "William Shakespeare"],
            "data_source": "nq", "prompt": prompt, "ability": "fact-reasoning",
            "reward_model": {"style": "rule", "ground_truth": {"target": ["Shakespeare", "William Shakespeare"]}},
            "extra_info": {"split": "train", "index": 0}}
    out = convert_row(full, 5, spec)
    assert (out["id"], out["question"], out["answers"], out["source"]) == ("train_0", "who wrote hamlet", ["Shakespeare", "William Shakespeare"], "nq")
    assert out["meta"] == {"ability": "fact-reasoning"}
    # only verl's columns: the question comes from the prompt, answers from the reward model, id from extra_info
    bare = {k: full[k] for k in ("data_source", "prompt", "reward_model", "extra_info")} | {"data_source": "hotpotqa"}
    out = convert_row(bare, 5, spec)
    assert (out["id"], out["question"], out["answers"], out["source"]) == ("0", "who wrote hamlet?", ["Shakespeare", "William Shakespeare"], "hotpotqa")


@pytest.mark.parametrize(
    "row, reason",
    [
        ({**MUSIQUE_NATIVE, "answerable": False}, "unanswerable"),
        ({"question": "Q", "golden_answers": ["", " "]}, "no non-empty gold answer"),
        ({"question": "Q"}, "no answer field"),
        ({"golden_answers": ["A"]}, "missing question"),
        ({"question": "Q", "possible_answers": "not json"}, "not a JSON list"),
    ],
)
def test_bad_rows_are_reasons(row, reason):
    with pytest.raises(RowError, match=reason):
        convert_row(row, 0, get_spec("musique"))


def test_hand_written_files_end_to_end(tmp_path, emapg_home, cli):
    (tmp_path / "2wiki_dev.json").write_text(json.dumps([TWOWIKI_NATIVE, {**TWOWIKI_NATIVE, "_id": "b", "answer": ""}]))
    (tmp_path / "musique_dev.jsonl").write_text("".join(json.dumps(r) + "\n" for r in
                                                        [MUSIQUE_NATIVE, {**MUSIQUE_NATIVE, "id": "x", "answerable": False}]))
    r = cli("prepare", "2wikimultihopqa", "--from", str(tmp_path / "2wiki_dev.json"))
    assert r.returncode == 0, r.stderr
    m = json.loads((emapg_home / "data" / "2wikimultihopqa" / "manifest.json").read_text())
    assert (m["rows"], m["dropped"], m["dropped_rows"][0]["id"]) == (1, 1, "b")
    r = cli("prepare", "musique", "--from", str(tmp_path / "musique_dev.jsonl"))
    assert r.returncode == 0, r.stderr
    assert "unanswerable" in r.stdout
    assert [e.answers for e in load_examples("musique")] == [["Miquette Giraudy", "M. Giraudy"]]


# --- every shared search file -------------------------------------------------------------------------

SHARED = [  # (dataset, file, rows kept, first id, first answers)
    ("nq", "nq_test_sample1k.jsonl", 1000, None, None),
    ("triviaqa", "triviaqa_test_sample1k.jsonl", 1000, None, None),
    ("popqa", "popqa_test_sample1k.jsonl", 1000, "test_10207", ["Ralph Rainger", "Ralph Reichenthal"]),
    ("bamboogle", "bamboogle_test.jsonl", 125, "test_0", ["james madison"]),
    ("hotpotqa", "hotpotqa_dev_distractor_first100.jsonl", 100, "5a8b57f25542995d1e6f1371", ["yes"]),
    ("hotpotqa", "hotpotqa_dev_ircot500.jsonl", 500, "5a8c7595554299585d9e36b6", ["Chief of Protocol"]),
]


@pytest.mark.parametrize("name, file, rows, first_id, first_answers", SHARED, ids=[s[1] for s in SHARED])
def test_prepare_every_shared_search_file(shared_data, tmp_path, emapg_home, name, file, rows, first_id, first_answers):
    src = shared_data / "search" / file
    out_dir, manifest = prepare_dataset(name, from_file=src, out=tmp_path / "out")
    source_rows = sum(1 for line in src.open() if line.strip())
    assert (manifest["rows"], manifest["dropped"]) == (rows, 0) and source_rows == rows
    examples = load_examples(str(out_dir))
    assert all(e.source == name for e in examples)
    if first_id:
        assert (examples[0].id, examples[0].answers) == (first_id, first_answers)
    raw = [json.loads(line) for line in src.open()]
    if "golden_answers" in raw[0]:  # FlashRAG files: every alias survives, in order
        assert [e.answers for e in examples] == [[a.strip() for a in dict.fromkeys(r["golden_answers"]) if a.strip()] for r in raw]
    if name == "hotpotqa":  # two gold paragraphs per question (HotpotQA's design)
        assert sum(len(e.meta["supporting_titles"]) == 2 for e in examples) == rows
