"""Multi-turn trajectories stay token-exact with a real byte-level BPE tokenizer, where text can merge across the
boundary of a policy turn and an observation: `</calc>` then `<result>` re-tokenise as `...</calc` `><` `result>`,
and an observation cut after ` t` followed by the policy's `he` re-tokenises as ` the`. The byte tokenizer of the
toys never merged anything, so nothing there could tell token-exact ids from ids re-tokenised from text.

Each test first checks that re-tokenising the episode's text gives other ids, whole or turn by turn (the policy's
turns hold a non-canonical split, "h" "e" for "he", as a sampler may draw one), so the test can fail; then that
the episode holds exactly the sampled ids and the observation's own ids, and that the engine was sent exactly those.
Two tokenizers: the fake SmolLM2 GGUF's (tests/smol_fakes.py, always) and the real SmolLM2's (marked `real`: it
needs `emapg prepare --preset smol`)."""

from __future__ import annotations

import pytest

from emapg_cli.data.schema import Example
from emapg_cli.engines.base import Completion, SamplingParams


def _fake_bpe(tmp_path_factory):
    pytest.importorskip("gguf")
    from transformers import AutoTokenizer

    from smol_fakes import write_tiny_gguf

    folder = tmp_path_factory.mktemp("bpe")
    write_tiny_gguf(folder / "tiny.gguf")
    return AutoTokenizer.from_pretrained(str(folder), gguf_file="tiny.gguf")


def _smol_bpe(tmp_path_factory):
    from transformers import AutoTokenizer

    from emapg_cli.paths import emapg_home

    folder = emapg_home() / "smol" / "model"
    if not (folder / "tokenizer.json").is_file():
        pytest.skip(f"{folder} is absent: run `emapg prepare --preset smol`")
    return AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module", params=[pytest.param(_fake_bpe, id="fake-gguf-bpe"),
                                        pytest.param(_smol_bpe, id="smollm2", marks=pytest.mark.real)])
def tok(request, tmp_path_factory):
    return request.param(tmp_path_factory)


def enc(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def he(tok) -> list[int]:
    """ "he" drawn as two tokens, "h" then "e": not the tokenizer's own encoding of "he" (one token)."""
    split = enc(tok, "h") + enc(tok, "e")
    assert enc(tok, "he") != split
    return split


class Scripted:
    """An engine that answers each context with the next scripted turn (ids), recording the contexts it was sent."""

    def __init__(self, turns: list[list[int]]):
        self.turns, self.contexts = list(turns), []

    def generate(self, prompts, params):
        self.contexts.append([list(p) for p in prompts])
        ids = self.turns.pop(0)
        return [[Completion(ids, "", "stop", [-0.5] * len(ids))] for _ in prompts]


def test_calculator_episode_keeps_the_ids_across_a_merging_boundary(tok):
    from emapg_cli.agents.environments import generate, make_environment

    call, answer = enc(tok, "<calc>2 * 3</calc>"), he(tok) + enc(tok, " \\boxed{6}")
    obs = enc(tok, "<result>6</result>")  # what the calculator answers, tokenised on its own
    whole = call + obs + answer
    assert enc(tok, tok.decode(whole)) != whole  # "><" merges: ids re-tokenised from text would differ
    assert enc(tok, tok.decode(answer)) != answer  # and so would the turn re-tokenised alone
    env = make_environment("calc", tok, max_context_tokens=4096)
    engine = Scripted([call, answer])
    prompt = enc(tok, "What is 2 * 3?")
    [[ep]] = generate(env.bind(engine), [prompt], SamplingParams(max_new_tokens=32), [Example(id="0", question="q", answers=["6"])])
    assert ep.token_ids == whole
    assert ep.policy_mask == [True] * len(call) + [False] * len(obs) + [True] * len(answer)
    assert ep.logprobs == [-0.5] * len(call) + [0.0] * len(obs) + [-0.5] * len(answer)
    assert engine.contexts == [[prompt], [prompt + call + obs]]  # the second turn saw the ids, not a re-tokenisation


def test_search_episode_keeps_the_ids_of_an_observation_cut_inside_a_word(tok):
    from emapg_cli.agents import SearchAgent, protocol
    from emapg_cli.config.models import SearchConfig
    from emapg_cli.retrieval.base import Hit

    hits = [Hit("1", "Doc", "Doc\nx tq y", 1.0)]
    full = enc(tok, protocol.information(hits))
    cut = next(i + 1 for i in range(len(full)) if tok.decode(full[:i + 1]).endswith(" t"))  # cut right after " t"
    search, answer = enc(tok, "<search> q </search>"), he(tok) + enc(tok, " <answer> x </answer>")
    obs = full[:cut]
    assert enc(tok, tok.decode(obs[-1:] + answer[:2])) != obs[-1:] + answer[:2]  # " t" + "h" "e" re-tokenises as " the"

    class Retriever:
        def search(self, queries, topk):
            return [hits for _ in queries]

        def close(self):
            pass

    s = SearchConfig(enabled=True, max_obs_tokens=cut, max_context_tokens=10_000, topk=1)
    engine = Scripted([search, answer])
    prompt = enc(tok, "Who?")
    [[ep]] = SearchAgent(tok, Retriever(), s, max_turns=1).generate(engine, [prompt], SamplingParams(max_new_tokens=32))
    assert ep.token_ids == search + obs + answer and ep.obs_cut == 1
    assert ep.policy_mask == [True] * len(search) + [False] * len(obs) + [True] * len(answer)
    assert engine.contexts[1] == [prompt + search + obs]
    assert ep.text == tok.decode(search, skip_special_tokens=True) + tok.decode(answer, skip_special_tokens=True)
