"""Search evaluation budgets and per-turn truncation (issue 18, fault 4 and search-qa's evaluation): eval.max_new_tokens
is per turn and must fit the context, data.eval takes a list scored per source, and an unanswered episode is truncated
only when its last policy turn hit the per-turn cap."""

from __future__ import annotations

import json
import os

import pytest
import torch

from emapg_cli.agents import SearchAgent
from emapg_cli.config.loading import load_config
from emapg_cli.config.models import SearchConfig
from emapg_cli.data.schema import Example
from emapg_cli.engines.base import Completion, SamplingParams
from emapg_cli.errors import UserError
from emapg_cli.models.tiny import build_byte_tokenizer
from emapg_cli.rewards.shaping import is_truncated, shape_rewards
from emapg_cli.train.rollout import score

WIDE = {"COLUMNS": "250"}  # the plan table on one line per row


class Scripted:
    """Replies to row i with its episode's next scripted turn; (episode key, turn) in `cut` reports `length`.
    Records each call's SamplingParams (the agent's per-turn budget)."""

    def __init__(self, tok, scripts, cut=frozenset()):
        self.tok, self.scripts, self.cut, self.params = tok, scripts, cut, []
        self.turn = {k: 0 for k in scripts}

    def generate(self, prompts, params):
        self.params.append(params)
        out = []
        for p in prompts:
            key, t = p[0], self.turn[p[0]]
            self.turn[key] += 1
            ids = self.tok(self.scripts[key][t], add_special_tokens=False)["input_ids"]
            out.append([Completion(ids, self.scripts[key][t], "length" if (key, t) in self.cut else "stop", [0.0] * len(ids))])
        return out


class NoHits:
    def search(self, queries, topk):
        return [[] for _ in queries]

    def close(self):
        pass


def ones(texts, examples):
    """A reward of 1 for every response: isolates the shaping (a real EM reward gives an unanswered episode 0)."""
    return [1.0] * len(texts)


def _episodes():
    tok = build_byte_tokenizer()  # one token per byte
    x, y, z = ord("X"), ord("Y"), ord("Z")
    scripts = {
        x: ["<search> q </search>", "a" * 16],            # search (20 tokens), then the final turn cut at the cap
        y: ["<search> never", "<answer>x</answer>"],     # turn 0 cut at the cap (invalid), final turn answers (18)
        z: ["no tags", "nothing"],                        # two turns that end on their own, never an answer
    }
    engine = Scripted(tok, scripts, cut={(x, 1), (y, 0)})
    agent = SearchAgent(tok, NoHits(), SearchConfig(enabled=True, max_context_tokens=4096), max_turns=1)
    groups = agent.generate(engine, [[x], [y], [z]], SamplingParams(max_new_tokens=20))
    return engine, [g[0] for g in groups]


def test_unanswered_is_not_truncated_only_a_last_turn_at_the_cap_is():
    engine, (ex, ey, ez) = _episodes()
    assert [p.max_new_tokens for p in engine.params] == [20, 20]  # every turn gets the per-turn budget
    assert (ex.outcome, ex.finish_reason, ex.last_turn_tokens) == ("no_answer", "length", 16)
    assert (ey.outcome, ey.finish_reason, ey.last_turn_tokens) == ("answer", "stop", 18)  # its cut turn 0 is not the last
    assert (ez.outcome, ez.finish_reason, ez.last_turn_tokens) == ("no_answer", "stop", 7)  # unanswered != truncated
    # the trainer's mask_truncated mask is is_truncated(finish_reason) per episode
    assert [is_truncated(e.finish_reason) for e in (ex, ey, ez)] == [True, False, False]
    # trajectories are longer than the cap (observations included), the last turns are not
    assert min(len(e.token_ids) for e in (ex, ey, ez)) > 20


def test_single_turn_shaping_is_unchanged():
    # a plain Completion has no turns: its own finish_reason decides (bit-identical rewards)
    cs = [Completion([1] * 18, "a", "stop"), Completion([1] * 20, "b", "length"), Completion([1] * 5, "c", "stop")]
    ex_ = [Example(id=str(i), question="q", answers=["x"]) for i in range(3)]
    rewards, _ = score(ones, cs, ex_, shaping=dict(truncated="zero"))
    assert rewards == shape_rewards([1.0] * 3, ["stop", "length", "stop"], truncated="zero")  # exact equality
    assert rewards == [1.0, 0.0, 1.0]


class _Acc:
    process_index, num_processes, device = 0, 1, torch.device("cpu")


def test_evaluate_scores_overall_and_per_source():
    from emapg_cli.train.evaluate import evaluate

    # 5 items: nq answers right, wrong, right; hotpotqa right, wrong. One greedy sample each.
    examples = [Example(id=f"{s}{i}", question="q", answers=["a"], source=s)
                for s, i in (("nq", 0), ("nq", 1), ("nq", 2), ("hotpotqa", 0), ("hotpotqa", 1))]
    right = {"nq0", "nq2", "hotpotqa0"}

    class Engine:
        def generate(self, prompts, params):
            assert params.max_new_tokens == 500
            return [[Completion([1], "ok" if examples[p[0]].id in right else "no", "stop")] for p in prompts]

    reward = lambda texts, exs: [1.0 if t == "ok" else 0.0 for t in texts]  # noqa: E731
    got = evaluate(Engine(), [[i] for i in range(5)], examples, reward, SamplingParams(max_new_tokens=500), _Acc())
    # overall 3 / 5 = 0.6; nq 2 / 3; hotpotqa 1 / 2
    assert got.accuracy == pytest.approx(0.6) and got.by_source == pytest.approx({"hotpotqa": 0.5, "nq": 2 / 3})
    assert got.metrics("eval/accuracy") == pytest.approx(
        {"eval/accuracy": 0.6, "eval/accuracy/hotpotqa": 0.5, "eval/accuracy/nq": 2 / 3})
    one = evaluate(Engine(), [[0], [1]], examples[:2], reward, SamplingParams(max_new_tokens=500), _Acc())
    assert one.metrics("eval/accuracy") == {"eval/accuracy": 0.5}  # one source: no per-source keys


def test_eval_list_keeps_sources_and_limits_each(tmp_path):
    from emapg_cli.train.preflight import config_checks, eval_refs, load_eval_examples

    plain = tmp_path / "mine.jsonl"  # canonical rows without a source: named after the file
    plain.write_text("".join(json.dumps({"id": f"p{i}", "question": "q", "answer": "a"}) + "\n" for i in range(3)))
    merged = tmp_path / "merged.jsonl"  # rows carrying their own source (Search-R1's merged test set)
    merged.write_text("".join(json.dumps({"id": f"m{i}", "question": "q", "answers": ["a"], "source": s}) + "\n"
                              for i, s in enumerate(["nq", "nq", "nq", "bamboogle"])))
    assert eval_refs(str(plain)) == [str(plain)] and eval_refs(None) == [] and eval_refs([]) == []
    exs = load_eval_examples([str(plain), str(merged)], limit=2)
    # first 2 of each source: mine p0 p1; nq m0 m1; bamboogle m3
    assert [(e.id, e.source) for e in exs] == [("p0", "mine"), ("p1", "mine"), ("m0", "nq"), ("m1", "nq"), ("m3", "bamboogle")]
    assert len(load_eval_examples([str(plain), str(merged)])) == 7
    with pytest.raises(UserError, match="twice"):
        config_checks(load_config(overrides=[f"data.eval=[{plain}, {plain}]"]))


def test_search_eval_budget_is_per_turn_and_checked():
    c = load_config(preset="search-qa")
    assert c.eval.max_new_tokens == c.rollout.max_new_tokens == 500  # unset: the per-turn rollout cap
    assert load_config(preset="search-qa", overrides=["rollout.max_new_tokens=300"]).eval.max_new_tokens == 300
    assert load_config().eval.max_new_tokens == 8192  # single-turn default unchanged
    with pytest.raises(UserError, match=r"eval.max_new_tokens \(8192, per turn\)"):
        load_config(preset="search-qa", overrides=["eval.max_new_tokens=8192"])
    # 2048 prompt + 2048 per turn = 4096 fits exactly; one more token does not
    assert load_config(preset="search-qa", overrides=["eval.max_new_tokens=2048"]).eval.max_new_tokens == 2048
    with pytest.raises(UserError, match="max_context_tokens"):
        load_config(preset="search-qa", overrides=["eval.max_new_tokens=2049"])


def test_search_qa_evaluates_like_the_official_run():
    c = load_config(preset="search-qa")
    # Search-R1 data_process.sh: the 7 FlashRAG test sets of qa_search_test_merge.py; ray_trainer._validate: greedy, n 1
    assert c.data.eval == ["nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle"]
    assert (c.eval.every, c.eval.n, c.eval.temperature, c.eval.top_p) == (50, 1, 0.0, 1.0)
    from emapg_cli.datasets import datasets

    cards = datasets()
    assert all(cards[name].role == "eval" and cards[name].answer_format == "qa_aliases" for name in c.data.eval)


def test_cli_eval_budget_above_the_context_fails_at_config_time(cli, emapg_home):
    r = cli("train", "--preset", "search-qa", "--set", "eval.max_new_tokens=8192", "--dry-run", env=WIDE)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "eval.max_new_tokens (8192, per turn)" in lines[0] and "search.max_context_tokens (4096)" in lines[0]
    assert "Plan" not in r.stdout  # nothing planned
    # `emapg eval --retriever`: --max-tokens is per turn and must leave room in --max-context-tokens
    r = cli("eval", "--bench", "nq", "--model", "m", "--retriever", "bm25:idx", "--max-tokens", "8192", env=WIDE)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "--max-tokens (8192, per turn" in lines[0], r.stderr


def test_cli_dry_run_shows_the_per_turn_evaluation_budget(cli, emapg_home):
    r = cli("train", "--preset", "search-qa", "--set", "data.eval=hotpotqa", "--dry-run", env=WIDE)
    assert r.returncode == 0, r.stderr
    out = " ".join(r.stdout.split())
    assert "evaluation │ greedy, <= 500 tokens per turn, context 4,096 (prompt <= 2,048); hotpotqa;" in out
    assert "data.eval: dataset 'hotpotqa' not found" in out  # a warning: the plan needs no data
    r = cli("train", "--preset", "search-qa", "--dry-run", env=WIDE)  # the shipped preset: the 7 sets, every 50 steps
    out = " ".join(r.stdout.split())
    assert r.returncode == 0 and "nq, triviaqa, popqa, hotpotqa, 2wikimultihopqa, musique, bamboogle;" in out
    assert "every 50 steps and at the end, eval/accuracy/<source> per source" in out
    assert out.count("warning: data.eval") == 7
