"""The search agent's turn loop on a scripted fake engine: exact token sequence, policy mask, log-probs, counts."""

from __future__ import annotations

import pytest

from emapg_cli.agents import SearchAgent, search_metrics
from emapg_cli.agents import protocol
from emapg_cli.config.models import SearchConfig
from emapg_cli.engines.base import Completion, SamplingParams
from emapg_cli.models.tiny import build_byte_tokenizer
from emapg_cli.retrieval.base import Hit


@pytest.fixture(scope="module")
def tok():
    return build_byte_tokenizer()  # one token per byte: token counts = byte counts


class ScriptedEngine:
    """Replies to each row with the next scripted turn of the episode whose prompt starts the context."""

    def __init__(self, tok, scripts: dict[int, list[str]], eos_after: set[tuple[int, int]] = frozenset(),
                 cut_at: set[tuple[int, int]] = frozenset()):
        """(episode key, turn) in `cut_at`: that turn reports finish_reason `length` (hit the per-turn cap)."""
        self.tok, self.scripts, self.eos_after, self.cut_at = tok, scripts, eos_after, cut_at
        self.calls: list[tuple[list[list[int]], SamplingParams]] = []
        self.turn_of: dict[int, int] = {k: 0 for k in scripts}

    def generate(self, prompts, params):
        self.calls.append(([list(p) for p in prompts], params))
        out = []
        for p in prompts:
            key = p[0]  # the test's prompts start with distinct bytes
            t = self.turn_of[key]
            self.turn_of[key] += 1
            ids = self.tok(self.scripts[key][t], add_special_tokens=False)["input_ids"]
            if (key, t) in self.eos_after:
                ids = ids + [self.tok.eos_token_id]
            logprobs = [-0.01 * (t + 1)] * len(ids)  # turn t's tokens carry -0.01 (t + 1)
            out.append([Completion(ids, "", "length" if (key, t) in self.cut_at else "stop", logprobs)])
        return out


class FakeRetriever:
    def __init__(self, docs: dict[str, list[Hit]]):
        self.docs, self.calls = docs, []

    def search(self, queries, topk):
        self.calls.append((list(queries), topk))
        return [self.docs[q][:topk] for q in queries]

    def close(self):
        pass


def enc(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_protocol_strings():
    template = protocol.load_template()
    assert template.startswith("Answer the given question. You must conduct reasoning inside <think>")
    assert "You can search as many times as your want." in template  # Search-R1's text, verbatim
    assert protocol.format_question("  Who is X ", template).endswith("Question: Who is X?\n")
    assert protocol.format_question("Who is X?", template).endswith("Question: Who is X?\n")
    assert protocol.parse_action("a <answer> no </answer> <search>\n q \n</search>") == ("answer", "no")  # first pair wins
    assert protocol.parse_action("<search> q") == (None, "")  # never closed: invalid
    hits = [Hit("7", "Evan Morris", '"Evan Morris"\nEvan L. Morris was\na lobbyist', 1.0), Hit("8", "B", "B\ntext b", 0.5)]
    assert protocol.information(hits) == ('\n\n<information>Doc 1(Title: "Evan Morris") Evan L. Morris was\na lobbyist\n'
                                          'Doc 2(Title: B) text b</information>\n\n')
    assert protocol.cut_after_action("x <answer> y </answer> z </search> w") == "x <answer> y </answer> z </search>"
    assert protocol.last_answer("<answer> a </answer> <answer> b </answer>") == "b"
    assert protocol.last_answer("<answer> a") is None


def test_turn_loop_exact_tokens_and_mask(tok):
    s = SearchConfig(enabled=True, max_obs_tokens=250, max_context_tokens=10_000, topk=2)
    long_doc = Hit("2", "Dog", '"Dog"\n' + "dogs bark " * 40, 2.0)
    short = [Hit("1", "Cat", "Cat\npurr", 3.0), Hit("9", "X", "X\nx", 0.1)]
    retriever = FakeRetriever({"cats": short, "dogs": [long_doc, short[0]], "more": short})
    a, b, c = ord("A"), ord("B"), ord("C")
    scripts = {
        a: ["<think>t</think><search> cats </search>",  # turn 0: search
            "I am not sure",                              # turn 1: no action -> invalid (ended with EOS)
            "<search> dogs </search>",                    # turn 2: search, observation cut at 250 tokens
            "<answer> Paris </answer>"],                  # turn 3 = the final no-search turn: answer
        b: ["<answer> Rome </answer>"],                   # answers at once
        c: ["<search> cats </search>", "<search> more </search>", "<search> cats </search>",
            "<search> more </search>"],                   # final turn searches: not executed, no answer
    }
    engine = ScriptedEngine(tok, scripts, eos_after={(a, 1)})
    agent = SearchAgent(tok, retriever, s, max_turns=3)
    prompts = [[a, 1, 2], [b, 1], [c]]
    params = SamplingParams(n=1, max_new_tokens=50, temperature=1.0, seed=5)
    groups = agent.generate(engine, prompts, params)
    ep_a, ep_b, ep_c = groups[0][0], groups[1][0], groups[2][0]

    obs1 = enc(tok, protocol.information(short))          # cats -> top-2 = both short docs
    invalid = enc(tok, s.invalid_message)
    obs2 = enc(tok, protocol.information([long_doc, short[0]]))[:250]  # cut at max_obs_tokens
    assert len(enc(tok, protocol.information([long_doc, short[0]]))) > 250 >= max(len(obs1), len(invalid))
    t0, t1 = enc(tok, scripts[a][0]), enc(tok, scripts[a][1]) + [tok.eos_token_id]
    t2, t3 = enc(tok, scripts[a][2]), enc(tok, scripts[a][3])
    assert ep_a.token_ids == t0 + obs1 + t1 + invalid + t2 + obs2 + t3
    assert ep_a.policy_mask == [True] * len(t0) + [False] * len(obs1) + [True] * len(t1) + [False] * len(invalid) \
        + [True] * len(t2) + [False] * len(obs2) + [True] * len(t3)
    assert ep_a.logprobs == [-0.01] * len(t0) + [0.0] * len(obs1) + [-0.02] * len(t1) + [0.0] * len(invalid) \
        + [-0.03] * len(t2) + [0.0] * len(obs2) + [-0.04] * len(t3)
    assert (ep_a.outcome, ep_a.finish_reason, ep_a.turns, ep_a.searches, ep_a.invalid, ep_a.obs_cut) == ("answer", "stop", 4, 2, 1, 1)
    assert ep_a.obs_tokens == len(obs1) + len(invalid) + 250
    assert ep_a.text == "".join(scripts[a])  # the policy's own text only: rewards never read observations
    assert "<information>" not in ep_a.text

    assert ep_b.token_ids == enc(tok, scripts[b][0]) and all(ep_b.policy_mask) and ep_b.outcome == "answer"
    # unanswered after the turn limit, but its last turn ended on </search>: not truncated (per turn)
    assert (ep_c.outcome, ep_c.finish_reason, ep_c.turns, ep_c.searches) == ("no_answer", "stop", 4, 3)
    assert (ep_a.last_turn_tokens, ep_c.last_turn_tokens) == (len(t3), len(enc(tok, scripts[c][3])))
    assert ep_c.token_ids[-len(enc(tok, scripts[c][3])):] == enc(tok, scripts[c][3])  # final search kept, no observation

    # engine calls: turn k sends every active episode's full context, stop strings, a per-turn seed
    assert [len(p) for p, _ in engine.calls] == [3, 2, 2, 2]
    assert engine.calls[1][0][0] == prompts[0] + t0 + obs1
    assert all(prm.stop == ("</search>", "</answer>") and prm.n == 1 for _, prm in engine.calls)
    assert len({prm.seed for _, prm in engine.calls}) == 4
    # one retriever call per turn with every search of the turn; turn 3's search is never sent
    assert retriever.calls == [(["cats", "cats"], 2), (["more"], 2), (["dogs", "cats"], 2)]

    m = search_metrics([ep_a, ep_b, ep_c], agent.latencies)
    assert m["search/calls_per_episode"] == pytest.approx(5 / 3)  # (2 + 0 + 3) / 3
    assert m["search/turns"] == pytest.approx(9 / 3)  # (4 + 1 + 4) / 3
    assert m["search/invalid_action_rate"] == pytest.approx(1 / 9)  # one invalid turn in 9
    obs = ep_a.obs_tokens + ep_c.obs_tokens
    total = len(ep_a.token_ids) + len(ep_b.token_ids) + len(ep_c.token_ids)
    assert m["search/obs_tokens_frac"] == pytest.approx(obs / total)
    assert m["search/answered_frac"] == pytest.approx(2 / 3)
    assert m["search/retriever_latency_s"] >= 0 and len(agent.latencies) == 3


def test_context_limit_cuts_observation_and_ends_episode(tok):
    """An observation longer than the room left is cut to fit; the episode then ends (outcome `context`)."""
    turn = "<search> q </search>"  # 20 tokens
    s = SearchConfig(enabled=True, max_obs_tokens=500, max_context_tokens=2 + 20 + 30 + 20)
    retriever = FakeRetriever({"q": [Hit("1", "T", "T\n" + "w " * 200, 1.0)]})
    engine = ScriptedEngine(tok, {ord("A"): [turn, turn]})
    agent = SearchAgent(tok, retriever, s, max_turns=4)
    (ep,), = agent.generate(engine, [[ord("A"), 0]], SamplingParams(max_new_tokens=20))
    # prompt 2 + turn 20 = 22; a second turn needs 20 more, so the observation may take 72 - 22 - ... room is
    # 72 - 22 = 50 tokens, cut to 50; then 72 + 20 > 72: no room for a turn -> context
    assert len(ep.token_ids) == 20 + 50 and ep.obs_cut == 1
    assert (ep.outcome, ep.turns, ep.finish_reason) == ("context", 1, "stop")  # ended by the context, not cut mid-turn
    assert search_metrics([ep], agent.latencies)["search/context_full_frac"] == 1.0


def test_unclosed_tags_are_invalid_and_counted(tok):
    """A model that never closes its tags (every turn cut by length) gets the invalid message each turn, no answer."""
    s = SearchConfig(enabled=True)
    engine = ScriptedEngine(tok, {ord("A"): ["<search> never closed", "<answer> nor this", "<search> x"]})
    agent = SearchAgent(tok, FakeRetriever({}), s, max_turns=2)
    (ep,), = agent.generate(engine, [[ord("A")]], SamplingParams(max_new_tokens=30))
    assert (ep.outcome, ep.turns, ep.invalid, ep.searches) == ("no_answer", 3, 2, 0)
    assert ep.token_ids.count(enc(tok, "M")[0]) >= 2  # the invalid message ("My previous action...") twice


def test_retokenize_compat_drops_eos_and_logprobs(tok):
    s = SearchConfig(enabled=True, retokenize=True)
    engine = ScriptedEngine(tok, {ord("A"): ["<answer> x </answer> trailing"]}, eos_after={(ord("A"), 0)})
    (ep,), = SearchAgent(tok, FakeRetriever({}), s, max_turns=1).generate(engine, [[ord("A")]], SamplingParams())
    assert ep.token_ids == enc(tok, "<answer> x </answer>") and ep.logprobs is None


def test_n_episodes_per_prompt_are_prompt_major(tok):
    scripts = {ord("A"): ["<answer> 1 </answer>"] * 3, ord("B"): ["<answer> 2 </answer>"] * 3}
    engine = ScriptedEngine(tok, scripts)
    groups = SearchAgent(tok, FakeRetriever({}), SearchConfig(enabled=True), 2).generate(
        engine, [[ord("A")], [ord("B")]], SamplingParams(n=3))
    assert [len(g) for g in groups] == [3, 3] and [p[0] for p in engine.calls[0][0]] == [65] * 3 + [66] * 3
    assert groups[1][2].text == "<answer> 2 </answer>"
