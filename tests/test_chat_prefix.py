"""`data.chat_prefix`: chat turns (a system message, few-shot user/assistant pairs) rendered before every question, in
training, its evaluations and `emapg eval --preset/--config` (which also stops on rollout.stop, as training's
evaluation does); recorded in eval's run.json (a resume with other turns is refused)."""

from __future__ import annotations

import json

import pytest

from emapg_cli.config import load_config
from emapg_cli.data.schema import Example
from emapg_cli.errors import UserError

DEMO = [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "<answer>Paris</answer>"}]


def _tok(path):
    from emapg_cli.models.loading import load_tokenizer

    return load_tokenizer(str(path))


def test_render_prompt_puts_the_turns_before_the_question(tiny_llama):
    from emapg_cli.models.prompts import render_prompt

    tok = _tok(tiny_llama)
    got = render_prompt(tok, "2+2?", [{"role": "system", "content": "Be brief."}, *DEMO])
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, *DEMO, {"role": "user", "content": "2+2?"}],
                                   add_generation_prompt=True, tokenize=False)
    assert got == tok(text, add_special_tokens=False)["input_ids"]
    alone = render_prompt(tok, "2+2?")
    assert len(got) > len(alone) and tok.decode(got).endswith(tok.decode(alone[-8:]))  # the question's turn closes both


def test_training_prompts_carry_the_prefix_and_count_it_against_the_budget(tiny_llama):
    from emapg_cli.models.prompts import render_prompt
    from emapg_cli.train.rollout import prepare_prompts

    tok = _tok(tiny_llama)
    examples = [Example(id="a", question="1+1", answers=["2"]), Example(id="b", question="x" * 40, answers=["1"])]
    plain = render_prompt(tok, "1+1")
    with_prefix = render_prompt(tok, "1+1", DEMO)
    kept, ids, skipped = prepare_prompts(tok, examples, len(with_prefix), prefix=DEMO)
    assert [e.id for e in kept] == ["a"] and ids == [with_prefix] and skipped == 1
    assert prepare_prompts(tok, examples[:1], len(with_prefix) - 1, prefix=DEMO)[2] == 1  # the prefix's tokens count
    assert prepare_prompts(tok, examples[:1], len(plain))[1] == [plain]


@pytest.mark.parametrize("turns, message", [
    ([{"role": "user", "content": "q"}], "then user/assistant pairs"),  # the question would follow a user turn
    ([{"role": "assistant", "content": "a"}, {"role": "user", "content": "q"}], "then user/assistant pairs"),
    ([*DEMO, {"role": "system", "content": "late"}], "then user/assistant pairs"),
    ([{"role": "bot", "content": "q"}], "Input should be 'system', 'user' or 'assistant'"),
    ([{"role": "user", "content": ""}, {"role": "assistant", "content": "a"}], "at least 1 character"),
    ([{"role": "user", "content": "q", "name": "x"}, {"role": "assistant", "content": "a"}], "allowed in data.chat_prefix.0: role, content"),
])
def test_a_malformed_prefix_is_a_config_error(turns, message):
    with pytest.raises(UserError, match="data.chat_prefix") as err:
        load_config("toy", overrides=[f"data.chat_prefix={json.dumps(turns)}"])
    assert message in str(err.value)


def test_a_system_turn_alone_or_first_is_accepted():
    cfg = load_config("toy", overrides=[f"data.chat_prefix={json.dumps([{'role': 'system', 'content': 'Be brief.'}, *DEMO])}"])
    assert [m["role"] for m in cfg.data.prefix_messages()] == ["system", "user", "assistant"]
    assert load_config("toy").data.prefix_messages() == []


def test_eval_with_a_config_uses_and_records_the_prefix(tiny_llama, tmp_path, cli):
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"id": "0", "question": "1+1", "answers": ["2"]}) + "\n")
    config = tmp_path / "c.yaml"
    config.write_text(f"data:\n  eval: {bench}\n  chat_prefix: {json.dumps(DEMO)}\nrollout:\n  stop: ['</answer>']\n"
                      "eval:\n  max_new_tokens: 2\n")
    out = tmp_path / "ev"
    r = cli("eval", "--config", str(config), "--model", str(tiny_llama), "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "2 chat turns before each question (data.chat_prefix)" in r.stdout
    assert "stop strings ['</answer>'] (rollout.stop)" in r.stdout
    run = json.loads((out / "run.json").read_text())
    assert run["chat_prefix"] == DEMO and run["stop"] == ["</answer>"]
    other = tmp_path / "c2.yaml"
    other.write_text(config.read_text().replace("Paris", "Lyon"))
    r = cli("eval", "--config", str(other), "--model", str(tiny_llama), "--out", str(out))
    assert r.returncode == 2 and "holds a run with other settings (chat_prefix:" in r.stderr
    # without a config no prefix is used, and none is recorded (runs written before the key existed resume)
    r = cli("eval", "--bench", str(bench), "--model", str(tiny_llama), "--n", "1", "--max-tokens", "2", "--out", str(tmp_path / "plain"))
    assert r.returncode == 0, r.stderr
    plain = json.loads((tmp_path / "plain" / "run.json").read_text())
    assert plain["chat_prefix"] is None and plain["stop"] is None
