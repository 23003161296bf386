"""The `search-qa` preset: its dry-run plan, and 2 real RL steps on CPU (tiny model, HotpotQA sample, BM25)."""

from __future__ import annotations

import json



def test_search_qa_dry_run(cli, emapg_home):
    r = cli("train", "--preset", "search-qa", "--dry-run")
    assert r.returncode == 0, r.stderr
    out = " ".join(r.stdout.split())
    assert "512 prompts x 5 responses" in out and "Qwen/Qwen2.5-3B" in out and "GPU memory estimate" in out


def test_search_qa_two_steps_on_cpu(shared_data, tiny_llama, tmp_path, emapg_home, cli, cli_many):
    # The preset as shipped, with only the model and the sizes overridden (--set): the shared HotpotQA sample
    # as training data, and a BM25 index of its 4,858 paragraphs in place of the wiki-18 server.
    src = shared_data / "search" / "hotpotqa_dev_ircot500.jsonl"
    prepared, r = cli_many(("prepare", "hotpotqa", "--from", str(src)),  # independent: at once
                           ("prepare", "hotpotqa-corpus", "--from", str(src), "--out", str(tmp_path / "corpus")))
    assert prepared.returncode == 0, prepared.stderr
    assert r.returncode == 0, r.stderr
    r = cli("retriever", "index", str(tmp_path / "corpus" / "corpus.jsonl"), "--out", str(tmp_path / "index"))
    assert r.returncode == 0, r.stderr
    run = tmp_path / "run"
    sets = {
        "model.path": str(tiny_llama), "model.dtype": "float32", "model.gradient_checkpointing": "false",
        "rollout.engine": "hf", "rollout.prompts_per_step": "2", "rollout.n": "2", "rollout.max_new_tokens": "8",
        "search.max_turns": "2", "train.steps": "2", "train.mini_batch_sequences": "4", "train.micro_batch_size": "4",
        "train.save_every": "0", "data.train": "hotpotqa", "data.max_prompt_tokens": "900",
        "search.retriever": "bm25", "search.index": str(tmp_path / "index"), "search.max_obs_tokens": "64",
        "search.max_context_tokens": "1000",  # the tiny model has 1024 positions; Search-R1's prompt is ~700 bytes
        "data.max_prompt_tokens": "900",  # prompt + one turn must fit in search.max_context_tokens (a config check)
        "data.eval": "hotpotqa", "data.eval_limit": "2",  # in place of the 7 test sets (not prepared here)
    }
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    r = cli("train", "--preset", "search-qa", *args, "--out", str(run), timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in rows if "search/calls_per_episode" in x]
    assert len(steps) == 2
    # greedy evaluation at step 0 and at the end (eval.every 50 > 2 steps), turns of eval.max_new_tokens =
    # rollout.max_new_tokens (8, per turn): 2 items, so an accuracy of 0, 1/2 or 1
    evals = [(x["step"], x["eval/accuracy"]) for x in rows if "eval/accuracy" in x]
    assert [s for s, _ in evals] == [0, 2] and all(a in (0.0, 0.5, 1.0) for _, a in evals)
    assert yaml_eval_budget(run) == 8
    for m in steps:
        assert 1 <= m["search/turns"] <= 3  # 2 search turns + the final one
        assert 0 <= m["search/invalid_action_rate"] <= 1 and 0 < m["search/obs_tokens_frac"] < 1


def yaml_eval_budget(run) -> int:
    """eval.max_new_tokens as the run's config.yaml resolved it."""
    import yaml

    return yaml.safe_load((run / "config.yaml").read_text())["eval"]["max_new_tokens"]
