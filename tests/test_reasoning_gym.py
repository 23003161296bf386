"""reasoning-gym as data (`emapg prepare reasoning-gym:TASK[,TASK...]`) and as a reward (`reasoning-gym`): the rows are
reasoning-gym's own, the scores are reasoning-gym's own `extract_answer` + the task's `score_answer`, in training
and in `emapg eval`; bad input is one line."""

from __future__ import annotations

import json

import pytest

rg = pytest.importorskip("reasoning_gym")

from reasoning_gym.utils import extract_answer  # noqa: E402

from emapg_cli.data.schema import Example  # noqa: E402
from emapg_cli.datasets.reasoning_gym_data import PROMPT_TEMPLATE, task_rows  # noqa: E402
from emapg_cli.rewards import get_reward  # noqa: E402


def _rows(folder):
    return [json.loads(line) for line in (folder / "data.jsonl").read_text().splitlines()]


def test_prepared_rows_are_reasoning_gyms_own_in_order(cli, tmp_path):
    out = tmp_path / "two"
    r = cli("prepare", "reasoning-gym:chain_sum,gcd", "--size", "7", "--seed", "5",
            "--task-config", '{"gcd": {"max_value": 50}}', "--out", str(out))
    assert r.returncode == 0, r.stderr
    expected = [("chain_sum", e, {}) for e in rg.create_dataset("chain_sum", size=7, seed=5)] + \
               [("gcd", e, {"max_value": 50}) for e in rg.create_dataset("gcd", size=7, seed=5, max_value=50)]
    rows = _rows(out)
    assert len(rows) == 14
    for i, (row, (task, entry, config)) in enumerate(zip(rows, expected)):
        assert row["question"] == PROMPT_TEMPLATE.format(question=entry["question"])
        assert row["answers"] == [entry["answer"]] and row["source"] == task
        assert row["meta"] == {"task": task, "config": config, "seed": 5, "size": 7, "index": i % 7, "question": entry["question"]}
    assert len({row["id"] for row in rows}) == 14
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["rows"] == 14 and manifest["seed"] == 5 and manifest["reasoning_gym_version"] == "0.1.25"
    assert manifest["tasks"] == [{"task": "chain_sum", "config": {}}, {"task": "gcd", "config": {"max_value": 50}}]
    # one task: its config given bare; another seed gives other rows
    r = cli("prepare", "reasoning-gym:gcd", "--size", "3", "--seed", "6", "--task-config", '{"max_value": 50}', "--out", str(tmp_path / "one"))
    assert r.returncode == 0, r.stderr
    assert [row["meta"]["question"] for row in _rows(tmp_path / "one")] == \
           [e["question"] for e in rg.create_dataset("gcd", size=3, seed=6, max_value=50)]


@pytest.mark.parametrize("name, config, message", [
    ("reasoning-gym:chain_sum,", None, "no empty task names"),
    ("reasoning-gym:gcd,gcd", None, "task gcd is given twice"),
    ("reasoning-gym:chain_sum", '{"bogus": 1}', "rejects the config {\"bogus\": 1}: TypeError"),
    ("reasoning-gym:chain_sum,gcd", '{"max_value": 5}', "keyed by the tasks (chain_sum, gcd)"),
    ("reasoning-gym:chain_sum", "[1]", "expected a JSON object, got list"),
    ("reasoning-gym:chain_sum", "{", "not valid JSON"),
    ("reasoning-gym:chain_sum", '{"seed": 3}', "give the size and seed with --size and --seed"),
])
def test_bad_references_and_configs_are_user_errors_before_any_write(tmp_path, name, config, message):
    from emapg_cli.datasets.reasoning_gym_data import prepare_reasoning_gym
    from emapg_cli.errors import UserError

    with pytest.raises(UserError) as err:
        prepare_reasoning_gym(name, 3, 0, config, tmp_path / "out")
    assert message in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()


def test_bad_input_on_the_command_line_is_one_line_exit_2_and_writes_nothing(cli_many, tmp_path):
    cases = [
        (["reasoning-gym:chain_sm"], "unknown reasoning-gym task 'chain_sm' (similar: chain_sum)"),
        (["reasoning-gym:chain_sum", "--task-config", '{"min_terms": 7}'], "rejects the config {\"min_terms\": 7}: AssertionError"),
        # accepted by the config's checks, refused when an item is drawn (3 operators' weights for 2 operators)
        (["reasoning-gym:simple_equations", "--task-config", '{"operators": ["+", "-"]}'], "(item 0): ValueError"),
        (["reasoning-gym:chain_sum", "--from", "x.jsonl"], "--from does not apply"),
        (["gsm8k", "--size", "3"], "--size and --task-config only apply to reasoning-gym"),
    ]
    outs = [tmp_path / f"out{i}" for i in range(len(cases))]
    results = cli_many(*[("prepare", *args, "--out", str(out)) for (args, _), out in zip(cases, outs)])
    for (args, message), out, r in zip(cases, outs, results):
        assert r.returncode == 2, (args, r.stderr)
        assert r.stderr.count("\n") == 1 and message in r.stderr, (args, r.stderr)
        assert not out.exists()


def _examples(task: str, config: dict, size: int = 6, seed: int = 3) -> list[Example]:
    return task_rows(task, config, size, seed)


def _hand_made(gold: str) -> dict[str, str]:
    return {
        "gold": f"<answer>{gold}</answer>",
        "gold, spaced": f"The result:\n<answer> {gold} </answer>",
        "wrong": "<answer>not it</answer>",
        "wrong then gold": f"<answer>zz</answer> no wait <answer>{gold}</answer>",  # the last tag counts
        "gold then wrong": f"<answer>{gold}</answer> no wait <answer>zz</answer>",
        "no tag": f"the answer is {gold}",
        "unclosed": f"<answer>{gold}",
        "partial": f"<answer>it is {gold}</answer>",
    }


@pytest.mark.parametrize("task, config", [
    ("chain_sum", {"min_terms": 2, "max_terms": 3}),
    ("gcd", {"max_value": 40}),
    ("number_sorting", {"min_numbers": 3, "max_numbers": 4}),  # a list answer, parsed by its own scorer
    ("letter_counting", {}),
])
def test_reward_equals_reasoning_gyms_own_scores(task, config):
    reward = get_reward("reasoning-gym")
    examples = _examples(task, config)
    dataset = rg.create_dataset(task, size=6, seed=3, **config)
    for ex, entry in zip(examples, dataset):
        cases = _hand_made(entry["answer"])
        got = reward(list(cases.values()), [ex] * len(cases))
        expected = [float(dataset.score_answer(extract_answer(r), entry)) for r in cases.values()]
        assert got == expected, (task, cases, got, expected)
        by_case = dict(zip(cases, got))
        assert by_case["gold"] == by_case["gold, spaced"] == by_case["wrong then gold"] == 1.0
        assert by_case["wrong"] == by_case["gold then wrong"] == by_case["no tag"] == by_case["unclosed"] == 0.0
    assert reward.errors == 0


def test_partial_credit_is_kept_as_reasoning_gym_gives_it():
    reward = get_reward("reasoning-gym")
    [ex] = [e for e in _examples("chain_sum", {"min_terms": 2, "max_terms": 2}, size=20) if len(e.answers[0]) == 2][:1]
    gold = ex.answers[0]
    # chain_sum's compute_decimal_reward: not a number, but the gold answer inside it -> len(gold) / len(answer)
    # "it is 42" is 8 characters, the gold 2: 2 / 8 = 0.25
    assert reward([f"<answer>it is {gold}</answer>"], [ex]) == [0.25]
    # a number equal to the gold as a decimal: full credit ("+0042.00" == "42")
    assert reward([f"<answer>+00{gold}.00</answer>"], [ex]) == [1.0]


def test_a_row_the_reward_cannot_rebuild_scores_zero_and_is_counted():
    reward = get_reward("reasoning-gym")
    [ex] = _examples("gcd", {}, size=1)
    edited = ex.model_copy(update={"meta": {**ex.meta, "question": "another question"}})
    plain = Example(id="x", question="1+1", answers=["2"])
    assert reward([f"<answer>{ex.answers[0]}</answer>"] * 3, [ex, edited, plain]) == [1.0, 0.0, 0.0]
    assert reward.errors == 2 and "rebuilds another question" in reward.first_error + reward.last_error


def test_eval_with_the_reward_keeps_every_score(cli, tmp_path):
    data = tmp_path / "bench"
    assert cli("prepare", "reasoning-gym:chain_sum", "--size", "2", "--seed", "0", "--out", str(data)).returncode == 0
    rows = _rows(data)
    golds = [r["answers"][0] for r in rows]
    given = tmp_path / "given.jsonl"
    given.write_text("".join(json.dumps({"id": r["id"], "responses": [f"<answer>{g}</answer>", "<answer>x</answer>",
                                                                      f"<answer>= {g}</answer>"]}) + "\n"
                             for r, g in zip(rows, golds)))
    r = cli("eval", "--bench", str(data), "--responses", str(given), "--reward", "reasoning-gym", "--out", str(tmp_path / "ev"))
    assert r.returncode == 0, r.stderr
    results = [json.loads(line) for line in (tmp_path / "ev" / "results.jsonl").read_text().splitlines()]
    for row, g in zip(results, golds):
        # "= 42": not a number, holds the gold -> partial len(g) / (len(g) + 2)
        assert row["scores"] == [1.0, 0.0, len(g) / (len(g) + 2)]
        assert row["correct"] == [True, False, False]
    summary = json.loads((tmp_path / "ev" / "summary.json").read_text())
    assert summary["avg@n"] == pytest.approx(1 / 3) and summary["reward"] == "reasoning-gym"


def test_training_uses_the_reward(tiny_llama, tmp_path):
    from train_helpers import run, tiny_overrides, train_cmd

    from emapg_cli.data.schema import write_jsonl

    data = tmp_path / "train.jsonl"
    write_jsonl(data, (e.model_dump() for e in _examples("chain_sum", {"min_terms": 2, "max_terms": 2}, size=8)))
    opts = tiny_overrides(tiny_llama, data, steps=1, **{"rollout.reward": "reasoning-gym", "eval.anchor_every": 0,
                                                       "data.max_prompt_tokens": 4096})
    proc = run(train_cmd(*opts, "--out", str(tmp_path / "run")))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[1]["reward/errors"] == 0 and "eval/accuracy" in rows[1]


def test_training_evaluation_counts_a_full_score_only():
    """eval/accuracy during training counts what `emapg eval` counts (score >= 1), not a partial credit above 0.5."""
    from types import SimpleNamespace

    from emapg_cli.engines.base import Completion, SamplingParams
    from emapg_cli.train.evaluate import evaluate
    from emapg_cli.train.rollout import solved_rule

    examples = [e for e in _examples("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2}, size=40)
                if len(e.answers[0]) == 2 and not e.answers[0].startswith("-")][:2]
    gold = [e.answers[0] for e in examples]
    # item 0: the gold answer (1.0); item 1: the gold with one digit after it, "<answer>{g}7</answer>": not a match,
    # but the gold is inside it: partial credit 2 / 3 = 0.67 > 0.5
    texts = [f"<answer>{gold[0]}</answer>", f"<answer>{gold[1]}7</answer>"]

    class Engine:
        def generate(self, prompts, params):
            return [[Completion([1], t, "stop", [0.0])] for t in texts[:len(prompts)]]

    reward = get_reward("reasoning-gym")
    assert reward(texts, examples) == [1.0, pytest.approx(2 / 3)]
    acc = SimpleNamespace(process_index=0, num_processes=1, device="cpu")
    scores = evaluate(Engine(), [[1], [2]], examples, reward, SamplingParams(n=1, max_new_tokens=4), acc)
    assert scores.accuracy == 0.5  # 1 of 2: the partial credit is not a solve
    assert solved_rule(get_reward("f1"))(2 / 3) and not solved_rule(reward)(2 / 3)  # f1 keeps "above 0.5"


# issue 40, item 1: spiral_matrix's scorer calls eval() on the answer; a scorer may hang; extract_answer is quadratic
PWNED = '<answer>__import__("os").system("touch PWNED")</answer>'
HANG = "<answer>next(x for x in iter(int,1) if x)</answer>"  # int() is 0 forever: spiral_matrix's eval never returns


def test_eval_runs_the_scorer_contained_cut_at_the_time_limit_and_counted(cli, tmp_path):
    work = tmp_path / "work"  # the user's folder: the eval's cwd
    work.mkdir()
    assert cli("prepare", "reasoning-gym:spiral_matrix", "--size", "1", "--out", "sm", cwd=work).returncode == 0
    [row] = _rows(work / "sm")
    (work / "r.jsonl").write_text(json.dumps({"id": row["id"], "responses": [PWNED, HANG, f"<answer>{row['answers'][0]}</answer>"]}) + "\n")
    # before: the scorer ran in emapg's process (PWNED in cwd) and the hang never ended (killed here after 120 s)
    r = cli("eval", "--bench", "sm", "--responses", "r.jsonl", "--reward", "reasoning-gym", "--grader-timeout", "2",
            "--out", "ev", cwd=work, timeout=120)
    assert r.returncode == 0, r.stderr
    assert not (work / "PWNED").exists() and sorted(p.name for p in work.iterdir()) == ["ev", "r.jsonl", "sm"]
    [result] = [json.loads(line) for line in (work / "ev" / "results.jsonl").read_text().splitlines()]
    assert result["scores"] == [0.0, 0.0, 1.0]  # eval'd to 0 (os.system's status): wrong; the hang cut at 2 s: 0
    summary = json.loads((work / "ev" / "summary.json").read_text())
    assert summary["grader_timeouts"] == 1


def test_the_reward_scores_in_workers_not_in_this_process(tmp_path, monkeypatch):
    import threading

    monkeypatch.chdir(tmp_path)
    [ex] = _examples("spiral_matrix", {}, size=1)
    reward = get_reward("reasoning-gym", timeout=2)
    gold = f"<answer>{ex.answers[0]}</answer>"
    # the cap keeps the end of a response: an answer followed by 20,000 characters is out of reach (16384 are seen)
    late = gold + "x" * 20_000
    box: dict = {}
    worker = threading.Thread(target=lambda: box.update(out=reward([PWNED, HANG, gold, late], [ex] * 4)), daemon=True)
    worker.start()
    worker.join(60)  # before: the hang ran in this process and never returned
    assert box.get("out") == [0.0, 0.0, 1.0, 0.0]
    assert reward.errors == 1 and reward.fn.timeouts == 1 and "timed out after 2 s" in reward.last_error
    assert not (tmp_path / "PWNED").exists()
    folder = reward.fn.folder  # the workers' private folder, deleted on close
    reward.close()
    assert not list(tmp_path.iterdir()) and not __import__("os").path.exists(folder)


def test_a_task_config_asking_for_too_much_work_is_refused(tmp_path, monkeypatch):
    """issue 40, item 7: `--task-config '{"min_numbers":10000000,...}'` generated without bound in emapg's process."""
    import threading

    from emapg_cli.datasets import reasoning_gym_data
    from emapg_cli.errors import UserError

    # one row of 10^6 numbers takes ~25 s (and ~400 MB) to generate: three are far past a 3 s limit
    monkeypatch.setattr(reasoning_gym_data, "GENERATE_TIMEOUT_S", 3.0, raising=False)  # raising: absent before
    out, box = tmp_path / "out", {}
    config = json.dumps({"min_numbers": 10 ** 6, "max_numbers": 10 ** 6})

    def run():
        try:
            reasoning_gym_data.prepare_reasoning_gym("reasoning-gym:number_sorting", 3, 0, config, out)
        except UserError as e:
            box["error"] = str(e)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(60)
    assert "more than 3 s or 4096 MiB" in box.get("error", ""), box
    assert not out.exists()


def test_the_scorers_private_folder_goes_with_the_reward_closed_or_not():
    """The workers' private temp folder: close() removes it, and so does dropping a reward nobody closed (CI runs left
    one empty `emapg-scorer-*` folder per unclosed reward in the temp dir)."""
    import gc
    from pathlib import Path

    from emapg_cli.rewards.reasoning_gym_reward import ReasoningGymReward

    closed = ReasoningGymReward(workers=1)
    folder = Path(closed.folder)
    assert folder.is_dir()
    closed.close()
    assert not folder.exists()
    closed.close()  # twice is harmless

    dropped = ReasoningGymReward(workers=1)
    folder = Path(dropped.folder)
    assert folder.is_dir()
    del dropped
    gc.collect()
    assert not folder.exists()
