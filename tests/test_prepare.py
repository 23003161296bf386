"""`emapg prepare`: conversion of local files and hub-shaped datasets, manifests, decontamination."""

from __future__ import annotations

import json

import pytest

from emapg_cli.datasets.loading import load_examples
from emapg_cli.datasets import datasets, get_spec
from emapg_cli.datasets import Fields, hub
from emapg_cli.datasets.convert import convert_row
from emapg_cli.datasets.rows import RowError
from emapg_cli.datasets.decontaminate import find_overlaps
from emapg_cli.datasets.prepare import decontaminate, prepare_dataset
from emapg_cli.fileio import sha256_file
from emapg_cli.datasets.registry import cards_dir, custom_spec, read_card
from emapg_cli.errors import UserError

GENERIC = custom_spec("mine")


def test_registry_describes_each_dataset_once():
    assert {"deepscaler", "math", "olympiadbench", "aime24", "aime25", "amc23", "math500", "minerva"} <= set(datasets())
    ob = get_spec("olympiadbench")
    assert (ob.hub_id, ob.config, ob.expected_rows) == ("Hothan/OlympiadBench", "OE_TO_maths_en_COMP", 675)
    with pytest.raises(UserError, match="unknown dataset 'nope'"):
        get_spec("nope")


@pytest.mark.parametrize("path", sorted(cards_dir().glob("*.yaml")), ids=lambda p: p.stem)
def test_every_dataset_card_is_valid(path):
    card = read_card(path)  # raises UserError on an unknown key, a bad value or a 'name' key
    assert card.name == path.stem and card.role in ("train", "eval")
    assert card.description and card.licence, "every card states what it is and its licence"
    assert card.hub_id or card.source.url, "a card says where the data comes from"


def test_bad_cards_are_one_line_errors(tmp_path):
    bad = tmp_path / "x.yaml"
    bad.write_text("role: eval\nsource: {hub: a/b, split: test, branch: main}\n")
    with pytest.raises(UserError, match=r"x.yaml: source.branch: Extra inputs are not permitted"):
        read_card(bad)
    bad.write_text("name: y\nrole: eval\n")
    with pytest.raises(UserError, match="a card's name is its file name"):
        read_card(bad)
    bad.write_text("role: eval\nexpected_rows: 0\n")
    with pytest.raises(UserError, match="expected_rows"):
        read_card(bad)


def test_qa_layouts_aliases_and_nested_fields():
    # FlashRAG JSONL: golden_answers is a list of aliases, all kept (any one is correct).
    flash = {"id": "test_0", "question": "Who?", "golden_answers": ["A. Lincoln", "Lincoln"], "metadata": {"x": 1}}
    out = convert_row(flash, 0, GENERIC)
    assert (out["id"], out["answers"]) == ("test_0", ["A. Lincoln", "Lincoln"])
    # HotpotQA: one answer string; the nested context (not a string) is neither prepended nor kept in meta;
    # `type` (bridge / comparison) is a common subset name, so eval breaks results down by it.
    hotpot = {"_id": "5a8b", "question": "Which?", "answer": "yes", "type": "comparison", "context": {"title": ["t"]}}
    out = convert_row(hotpot, 0, GENERIC)
    assert (out["id"], out["question"], out["answers"]) == ("5a8b", "Which?", ["yes"])
    assert out["meta"] == {"type": "comparison", "subset": "comparison"}
    # IRCoT layout, read through a card's dotted paths.
    ircot = {"question_id": "q1", "question_text": "When?", "answers_objects": [{"number": "", "spans": ["1999", "in 1999"]}]}
    card = get_spec("olympiadbench").model_copy(update={"fields": Fields(question="question_text", answer="answers_objects.0.spans")})
    out = convert_row(ircot, 0, card)
    assert (out["id"], out["question"], out["answers"], out["meta"]) == ("q1", "When?", ["1999", "in 1999"], {})


@pytest.mark.parametrize(
    "row, question, answers, id_",
    [
        ({"question": "Q", "answer": "3"}, "Q", ["3"], "7"),  # no id field: the row index
        ({"problem": "Q", "final_answer": ["$1,3$"], "unique_id": "u"}, "Q", ["$1,3$"], "u"),
        ({"prompt": [{"role": "user", "content": "Q"}], "answer": 142.0, "problem_id": 9}, "Q", ["142"], "9"),
        ({"problem": "Q", "solution": "so \\boxed{\\frac{1}{2}}."}, "Q", ["\\frac{1}{2}"], "7"),
        ({"question": "Q", "answer": 0.25}, "Q", ["0.25"], "7"),
    ],
)
def test_convert_row_common_field_names(row, question, answers, id_):
    out = convert_row(row, 7, GENERIC)
    assert (out["question"], out["answers"], out["id"]) == (question, answers, id_)


@pytest.mark.parametrize(
    "row, reason",
    [
        ({"answer": "1"}, "no question field"),
        ({"question": "Q"}, "no answer field"),
        ({"question": "Q", "solution": "no box here"}, "no \\\\boxed"),
        ({"question": "Q", "answer": True}, "boolean answer"),
        ({"question": "  ", "answer": "1"}, "empty or missing question"),
    ],
)
def test_convert_row_reasons(row, reason):
    with pytest.raises(RowError, match=reason):
        convert_row(row, 0, GENERIC)


def test_local_file_drops_are_reported(tmp_path, emapg_home):
    rows = [
        {"problem": "What is 1+1?", "answer": "2", "type": "Algebra"},
        {"problem": "What is  1+1?", "answer": "2"},  # same question up to whitespace: duplicate
        {"problem": "No answer here", "answer": None},  # invalid
        {"problem": "What is 2+2?", "answer": 4.0},
    ]
    src = tmp_path / "rows.json"
    src.write_text(json.dumps({"data": rows}))
    out_dir, manifest = prepare_dataset("mine", from_file=src)
    assert out_dir == emapg_home / "data" / "mine"
    assert manifest["rows"] == 2 and manifest["dropped"] == 2
    assert manifest["dropped_by_reason"] == {"duplicate": 1, "invalid": 1}
    assert [d["index"] for d in manifest["dropped_rows"]] == [1, 2]
    assert manifest["sha256"] == sha256_file(out_dir / "data.jsonl")
    examples = load_examples("mine")  # what the trainer calls
    assert [e.answers for e in examples] == [["2"], ["4"]]
    assert examples[0].meta == {"type": "Algebra", "subset": "Algebra"}


def test_hub_path_with_a_fake_hub(monkeypatch, tmp_path):
    # No network: the loader returns a hub-shaped dataset (datasets.Dataset when installed).
    rows = [
        {"problem": "Compute $1+1$.", "solution": "...", "answer": "2", "subject": "Algebra", "level": 1, "unique_id": "a/1"},
        {"problem": "Compute $2+2$.", "solution": "...", "answer": "4", "subject": "Geometry", "level": 2, "unique_id": "b/2"},
    ]
    try:
        import datasets

        fake = datasets.Dataset.from_list(rows)
    except ImportError:
        fake = rows  # the same interface for our use: iterable of dict rows
    seen = {}
    monkeypatch.setattr(hub, "load_dataset", lambda spec: seen.setdefault("spec", spec) and fake)
    monkeypatch.setattr(hub, "resolve_revision", lambda spec: "0123abc")
    out_dir, manifest = prepare_dataset("math500", out=tmp_path / "m500")
    assert seen["spec"].hub_id == "HuggingFaceH4/MATH-500"
    assert manifest["source"] == "hf://datasets/HuggingFaceH4/MATH-500"
    assert (manifest["revision"], manifest["split"], manifest["rows"]) == ("0123abc", "test", 2)
    ex = load_examples(str(out_dir))
    assert [e.id for e in ex] == ["a/1", "b/2"] and ex[1].meta["subset"] == "Geometry"


def test_hub_without_datasets_is_a_user_error(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "datasets", None)  # import fails
    with pytest.raises(UserError, match="pip install datasets"):
        hub.load_dataset(get_spec("aime24"))


def test_parquet(tmp_path, emapg_home):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist([{"question": "Q1", "answer": "1"}]), tmp_path / "d.parquet")
    _, manifest = prepare_dataset("pq", from_file=tmp_path / "d.parquet")
    assert manifest["rows"] == 1


def test_decontamination_exact_and_ngram(tmp_path, emapg_home):
    long_q = "Let ABC be a triangle with sides 3 4 and 5 and let D be the foot of the altitude from C"
    train = [
        {"id": "t1", "question": "What is 1+1?", "answer": "2"},  # exact (case and spaces differ)
        {"id": "t2", "question": "Prove it. " + long_q + ". Find CD.", "answer": "2.4"},  # shares a 13-gram
        {"id": "t3", "question": "A fresh problem about primes.", "answer": "7"},
    ]
    evals = [{"id": "e1", "question": "what is  1+1?", "answer": "2"}, {"id": "e2", "question": long_q + "?", "answer": "1"}]
    for name, rows in (("tr", train), ("ev", evals)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        prepare_dataset(name, from_file=tmp_path / f"{name}.jsonl")
    found = find_overlaps(load_examples("tr"), {"ev": load_examples("ev")}, n=13)
    assert [(o.train_id, o.eval_id, o.kind) for o in found] == [("t1", "e1", "exact"), ("t2", "e2", "ngram")]
    assert find_overlaps(load_examples("tr"), {"ev": load_examples("ev")}, n=30)[1:] == []  # 30 > words
    overlaps, rewritten = decontaminate("tr", ["ev"], remove=True)
    assert len(overlaps) == 2 and [e.id for e in load_examples("tr")] == ["t3"]
    manifest = json.loads((rewritten / "manifest.json").read_text())
    assert manifest["rows"] == 1 and len(manifest["decontaminated"]["removed"]) == 2


# --- the real CLI on the shared benchmark files ----------------------------------------------------------


def test_cli_prepare_olympiadbench_and_math(shared_data, emapg_home, cli):
    r = cli("prepare", "olympiadbench", "--from", str(shared_data / "math" / "olympiadbench_test.jsonl"))
    assert r.returncode == 0, r.stderr
    ob = load_examples("olympiadbench")
    assert len(ob) == 675
    by_id = {e.id: e for e in ob}
    assert by_id["2592"].meta["tolerance"] == 0.1 and by_id["1709"].answers == ["1,3,5"]
    assert {e.meta["subset"] for e in ob} == {"Algebra", "Combinatorics", "Geometry", "Number Theory"}

    r = cli("prepare", "math", "--from", str(shared_data / "math" / "math_train.json"))
    assert r.returncode == 0, r.stderr
    manifest = json.loads((emapg_home / "data" / "math" / "manifest.json").read_text())
    # 7474 rows: 4 without a usable answer and 1 repeated question are reported, not silently lost.
    assert (manifest["rows"], manifest["dropped"]) == (7469, 5)
    assert manifest["dropped_by_reason"] == {"invalid": 4, "duplicate": 1}
    assert len(load_examples("math")) == 7469


def test_cli_prepare_warns_on_a_row_count_the_card_does_not_expect(shared_data, emapg_home, cli):
    # rllm's amc.json holds AMC 12 2022 and 2023 (83 rows); the amc23 card expects the 40 AMC 2023 problems.
    r = cli("prepare", "amc23", "--from", str(shared_data / "math" / "amc_test.json"))
    assert r.returncode == 0, r.stderr
    assert "warning: wrote 83 rows but the dataset card of 'amc23' expects 40" in " ".join(r.stderr.split())
    manifest = json.loads((emapg_home / "data" / "amc23" / "manifest.json").read_text())
    assert (manifest["rows"], manifest["expected_rows"]) == (83, 40)
    r = cli("prepare", "mine", "--from", str(shared_data / "math" / "amc_test.json"))  # no card: no expectation
    assert r.returncode == 0 and "warning" not in r.stderr


def test_cli_errors(cli, emapg_home, tmp_path):
    r = cli("prepare", "nope")
    assert r.returncode == 2 and "unknown dataset 'nope'" in r.stderr
    r = cli("prepare", "x", "--from", str(tmp_path / "missing.json"))
    assert r.returncode == 2 and "no such file" in r.stderr


def test_progress_shows_a_bracketed_name_as_written(cli, emapg_home, tmp_path):
    """The converting bar escapes its label once: `my[x]` is printed as `my[x]`, not Rich markup and not `my\\[x]`
    (prepare escaped it a second time before the bar did; caught when the bars became one helper)."""
    src = tmp_path / "q[1].jsonl"
    src.write_text("".join(json.dumps({"problem": f"1+{i}?", "answer": str(1 + i)}) + "\n" for i in range(3)))
    r = cli("prepare", "my[x]", "--from", str(src), env={"EMAPG_PROGRESS_SECONDS": "0"})
    assert r.returncode == 0, r.stderr
    lines = [line for line in (r.stdout + r.stderr).splitlines() if line.startswith("converting")]
    assert lines and all(line.startswith("converting my[x] ") for line in lines), lines
