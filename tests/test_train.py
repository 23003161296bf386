"""`emapg train`: the engine, the log-prob passes, every KL estimator in the loss, outputs, bad input, the olympiad path."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from emapg_cli.config.loading import load_config
from emapg_cli.engines.base import SamplingParams
from emapg_cli.errors import UserError
from train_helpers import OneProcess, load_weights, run, settings_of, tiny_overrides, train_cmd, write_dataset

ESTIMATOR_CASES = [("k3", "reverse"), ("k5", "forward"), ("topk", "reverse"), ("topk", "forward"),
                   ("topk_paper", "reverse"), ("truncated", "forward"), ("exact", "reverse"), ("exact", "forward")]


@pytest.fixture(scope="module")
def lm_and_tok(tiny_qwen2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(tiny_qwen2).eval(), AutoTokenizer.from_pretrained(tiny_qwen2)


def _rollout_batch(lm, tok, n=3, max_new=5, topk=4):
    from emapg_cli.engines.hf import HFEngine
    from emapg_cli.models.prompts import render_prompt
    from emapg_cli.train.rollout import build_batch

    prompts = [render_prompt(tok, q) for q in ("1+2", "what is 13*17?")]
    groups = HFEngine(lm, tok).generate(prompts, SamplingParams(n=n, max_new_tokens=max_new, seed=3, topk=topk))
    comps = [c for g in groups for c in g]
    adv = torch.linspace(-1, 1, len(comps))
    return build_batch([p for p in prompts for _ in range(n)], comps, adv, tok.pad_token_id), comps


# ---------------------------------------------------------------- engine
def test_hf_engine_seeds_stop_and_greedy(lm_and_tok):
    from emapg_cli.engines.hf import HFEngine

    lm, tok = lm_and_tok
    eng = HFEngine(lm, tok, batch_size=4)
    p = [tok("ab", add_special_tokens=False)["input_ids"], tok("a longer prompt", add_special_tokens=False)["input_ids"]]
    params = SamplingParams(n=3, max_new_tokens=6, seed=11)
    a, b = eng.generate(p, params), eng.generate(p, params)
    assert [[c.token_ids for c in g] for g in a] == [[c.token_ids for c in g] for g in b]  # per-row seeds
    assert len({tuple(c.token_ids) for c in a[0]}) > 1  # the samples of a group differ
    # each sample keeps its seed when generated alone in a batch of one (row 0 <-> same seed)
    solo = HFEngine(lm, tok, batch_size=1).generate(p, params)
    assert [c.token_ids for c in solo[1]] == [c.token_ids for c in a[1]]
    # greedy = argmax of the model at each step (checked for the first token)
    g = eng.generate(p[:1], SamplingParams(n=1, max_new_tokens=2, temperature=0))[0][0]
    with torch.no_grad():
        first = lm(torch.tensor([p[0]])).logits[0, -1].argmax().item()
    assert g.token_ids[0] == first and len(g.logprobs) == len(g.token_ids)
    # a stop string ends the completion; the text is cut before it
    text = a[0][0].text
    stop = text[2:3] if len(text) > 3 else None
    if stop:
        c = eng.generate(p[:1], SamplingParams(n=3, max_new_tokens=6, seed=11, stop=(stop,)))[0][0]
        assert c.finish_reason == "stop" and stop not in c.text


# ---------------------------------------------------------------- log-prob passes
def test_chunked_token_stats_match_full_logits(lm_and_tok):
    from emapg_cli.train.logprobs import position_ids, token_stats

    lm, tok = lm_and_tok
    batch, _ = _rollout_batch(lm, tok)
    with torch.no_grad():
        st = token_stats(lm, batch.input_ids, batch.attention_mask, batch.prompt_len, batch.response_mask, topk=4, chunk=3)
        logits = lm(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                    position_ids=position_ids(batch.attention_mask)).logits[:, batch.prompt_len - 1:-1]  # [B, R, V]
    ref = torch.log_softmax(logits.float(), -1)
    m = batch.response_mask
    want = ref.gather(-1, batch.targets[..., None]).squeeze(-1)
    assert torch.allclose(st.logp[m], want[m], atol=1e-5)
    assert torch.equal(st.topk_index[m], logits.topk(4, -1).indices[m])
    assert torch.allclose(st.logp_q[m], ref.gather(-1, st.topk_index)[m], atol=1e-5)
    ent = -(ref.exp() * ref).sum(-1)
    assert torch.allclose(st.entropy[m], ent[m], atol=1e-4)
    assert torch.all(st.logp[~m] == 0)


def test_engine_logprobs_match_trainer_pass(lm_and_tok):
    from emapg_cli.train.logprobs import token_stats

    lm, tok = lm_and_tok
    # a checkpoint's own generation defaults must not change what the engine samples from
    lm.generation_config.repetition_penalty, lm.generation_config.no_repeat_ngram_size = 3.0, 2
    try:
        batch, _ = _rollout_batch(lm, tok)
    finally:
        lm.generation_config.repetition_penalty, lm.generation_config.no_repeat_ngram_size = None, None
    with torch.no_grad():
        st = token_stats(lm, batch.input_ids, batch.attention_mask, batch.prompt_len, batch.response_mask)
    m = batch.response_mask
    # KV-cached generation and a full forward agree to float32 round-off
    assert torch.allclose(st.logp[m], batch.sampling_logp[m], atol=1e-4)


def test_engine_topk_equals_the_old_policy_pass(lm_and_tok):
    """The hf engine's recorded top-k ids are the trainer's old-policy top-k (train.old_logprobs=engine skips that
    pass), and with old_logprobs=engine the passes take old_logp from the engine's log-probs."""
    from emapg_cli.train.logprobs import TokenScorer, token_stats
    from emapg_cli.train.passes import reference_passes

    lm, tok = lm_and_tok
    batch, _ = _rollout_batch(lm, tok, topk=4)
    with torch.no_grad():
        st = token_stats(lm, batch.input_ids, batch.attention_mask, batch.prompt_len, batch.response_mask, topk=4)
    m = batch.response_mask
    assert torch.equal(batch.q_index[m], st.topk_index[m])
    over = ["kl.estimator=topk", "kl.k=4", "rollout.prompts_per_step=2", "train.mini_batch_prompts=1"]
    engine = load_config(overrides=over)  # auto + hf engine: from the engine
    assert not settings_of(engine).old_pass and settings_of(load_config(overrides=over + ["train.old_logprobs=pass"])).old_pass
    out = reference_passes(TokenScorer(lm), TokenScorer(lm), batch.with_(q_index=batch.q_index), settings_of(engine))
    assert torch.equal(out.old_logp, batch.sampling_logp) and torch.equal(out.q_index, batch.q_index)


@pytest.mark.parametrize("estimator,direction", ESTIMATOR_CASES)
def test_every_estimator_trains(lm_and_tok, estimator, direction):
    """Reference passes + micro-batch loss for each estimator: finite loss; at step 0 (policy == anchor) KL = 0."""
    from emapg_cli.train.loading import make_anchor
    from emapg_cli.train.logprobs import TokenScorer
    from emapg_cli.train.passes import reference_passes
    from emapg_cli.train.update import micro_batch_loss

    lm, tok = lm_and_tok
    cfg = load_config(overrides=[f"kl.estimator={estimator}", f"kl.direction={direction}", "kl.k=4", "kl.coef=0.5",
                                 "rollout.prompts_per_step=2", "train.mini_batch_prompts=1", "train.micro_batch_size=4",
                                 "train.logit_chunk=5"])
    batch, _ = _rollout_batch(lm, tok)
    anchor = make_anchor(lm)
    scorer = TokenScorer(lm)
    batch = reference_passes(scorer, TokenScorer(anchor), batch, settings_of(cfg))
    parts = micro_batch_loss(scorer, batch, settings_of(cfg), float(batch.response_mask.sum()), 6.0, anchor)
    assert math.isfinite(float(parts.loss.detach()))
    assert abs(parts.kl) < 1e-5  # policy == anchor: every estimator's value is 0 (up to round-off)
    parts.loss.backward()
    grads = [p.grad for p in lm.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    lm.zero_grad(set_to_none=True)


@pytest.mark.parametrize("estimator", ["topk", "exact", "k3"])
def test_shared_prompts_give_the_padded_passes_and_update(lm_and_tok, estimator):
    """train.share_prompts=always vs never through the trainer's own pieces (reference passes, the micro-batch
    loss, its backward): 2 prompts x 3 samples, so each prompt is shared by 3 rows; `exact` also shares the
    anchor's hidden states inside the loss. Same reference log-probs, loss, KL and gradients to 1e-5."""
    from emapg_cli.train.loading import make_anchor
    from emapg_cli.train.logprobs import TokenScorer
    from emapg_cli.train.passes import reference_passes
    from emapg_cli.train.update import micro_batch_loss

    lm, tok = lm_and_tok
    batch, _ = _rollout_batch(lm, tok)
    anchor = make_anchor(lm)
    with torch.no_grad():  # an anchor that differs from the policy, so the KL and its gradient are not 0
        for p in anchor.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    out = []
    for share in ("never", "always"):
        cfg = load_config(overrides=[f"kl.estimator={estimator}", "kl.k=4", "kl.coef=0.5", "rollout.prompts_per_step=2",
                                     "train.mini_batch_prompts=1", "train.micro_batch_size=6", "train.logit_chunk=5",
                                     "train.old_logprobs=pass", f"train.share_prompts={share}", "train.pack_sequences=never"])
        filled = reference_passes(TokenScorer(lm), TokenScorer(anchor), batch, settings_of(cfg))
        lm.zero_grad(set_to_none=True)
        parts = micro_batch_loss(TokenScorer(lm), filled, settings_of(cfg), float(batch.response_mask.sum()), 6.0, anchor)
        parts.loss.backward()
        out.append((filled, parts, [p.grad.clone() for p in lm.parameters()]))
    lm.zero_grad(set_to_none=True)
    (fa, pa, ga), (fb, pb, gb) = out
    mask = batch.response_mask.bool()
    torch.testing.assert_close(fb.old_logp[mask], fa.old_logp[mask], rtol=1e-5, atol=1e-6)
    if fa.ref_logp is not None:
        torch.testing.assert_close(fb.ref_logp[mask], fa.ref_logp[mask], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pb.loss.detach(), pa.loss.detach(), rtol=1e-5, atol=1e-6)
    assert abs(pb.kl - pa.kl) <= 1e-5 * max(1.0, abs(pa.kl)) and abs(pa.kl) > 1e-6  # a KL that is not 0, the same
    for x, y in zip(gb, ga):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def test_skipped_steps_leave_weights_optimizer_and_schedule_untouched(tiny_qwen2):
    """NaN advantages make every mini-batch's loss non-finite: 2 optimizer steps skipped, weights, AdamW state and
    the warm-up schedule unchanged; the same batch with finite advantages takes both steps and advances the schedule."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from emapg_cli.train.logprobs import TokenScorer
    from emapg_cli.train.parallel import Replicated
    from emapg_cli.train.setup import make_scheduler
    from emapg_cli.train.update import update_policy

    lm, tok = AutoModelForCausalLM.from_pretrained(tiny_qwen2), AutoTokenizer.from_pretrained(tiny_qwen2)
    cfg = load_config(overrides=["rollout.prompts_per_step=2", "rollout.n=3", "train.mini_batch_prompts=1",
                                 "train.micro_batch_size=2", "kl.coef=0", "train.steps=4", "optim.warmup_ratio=0.5"])
    batch, _ = _rollout_batch(lm, tok)
    scorer = TokenScorer(lm)
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-3)
    sched = make_scheduler(opt, cfg)  # 4 RL steps x 2 optimizer steps = 8; warm-up over 4: lr = 1e-3 * (i + 1) / 4
    before = [p.detach().clone() for p in lm.parameters()]
    bad = batch.with_(advantages=torch.full_like(batch.advantages, float("nan")))
    stats = update_policy(Replicated(OneProcess()), scorer, bad, settings_of(cfg), opt, sched, torch.Generator().manual_seed(0))
    assert stats.skipped == 2 and sched.last_epoch == 0 and not opt.state
    assert sched.get_last_lr()[0] == pytest.approx(0.25e-3)
    assert all(torch.equal(a, b) for a, b in zip(before, lm.parameters()))
    stats = update_policy(Replicated(OneProcess()), scorer, batch, settings_of(cfg), opt, sched, torch.Generator().manual_seed(0))
    assert stats.skipped == 0 and sched.last_epoch == 2
    # one on-policy mini-batch (the only case without an old-policy pass): the update's own pass runs on the
    # sampling weights and compares every response token's log-prob with the engine's
    lm2 = AutoModelForCausalLM.from_pretrained(tiny_qwen2)
    one = load_config(overrides=["rollout.prompts_per_step=2", "rollout.n=3", "train.mini_batch_prompts=2", "kl.coef=0"])
    opt2 = torch.optim.AdamW(lm2.parameters(), lr=1e-3)
    stats = update_policy(Replicated(OneProcess()), TokenScorer(lm2), batch, settings_of(one), opt2, make_scheduler(opt2, one),
                          torch.Generator().manual_seed(0))
    assert sum(d.numel() for d in stats.logprob_diffs) == int(batch.response_mask.sum())
    assert float(torch.cat(stats.logprob_diffs).abs().max()) < 1e-3
    assert sched.get_last_lr()[0] == pytest.approx(0.75e-3)  # (2 + 1) / 4 after two steps taken
    assert not all(torch.equal(a, b) for a, b in zip(before, lm.parameters()))


# ---------------------------------------------------------------- bad input
def _cfg(tiny, data, *extra):
    return load_config(overrides=[f"model.path={tiny}", f"data.train={data}", "rollout.reward=math", *extra])


def test_bad_inputs_are_one_line_user_errors(tiny_qwen2, tmp_path):
    from emapg_cli.train.preflight import preflight

    data = write_dataset(tmp_path / "d.jsonl")
    with pytest.raises(UserError, match="no such model folder"):
        preflight(_cfg(tmp_path / "nope", data))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "1", "question": "2+2"}\n')
    with pytest.raises(UserError, match="answers"):
        preflight(_cfg(tiny_qwen2, bad))
    with pytest.raises(UserError, match="reward"):
        preflight(_cfg(tiny_qwen2, data, "rollout.reward=no_such_reward"))
    with pytest.raises(UserError, match="vocabulary"):
        preflight(_cfg(tiny_qwen2, data, "kl.estimator=topk", "kl.k=100000"))
    with pytest.raises(UserError, match="search.max_turns"):  # the turn limit moved to the environment
        preflight(_cfg(tiny_qwen2, data, "rollout.max_turns=4"))


def test_cli_bad_input_exits_2_before_compute(tmp_path):
    data = write_dataset(tmp_path / "d.jsonl")
    proc = subprocess.run([sys.executable, "-m", "emapg_cli", "train", "--set", f"model.path={tmp_path / 'missing'}",
                           "--set", f"data.train={data}", "--out", str(tmp_path / "run")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error:") and "missing" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_dry_run_prints_plan_without_weights(tmp_path, cli_many):
    proc, sharded, misused = cli_many(  # three independent commands, two at a time
        ("train", "--preset", "olympiad", "--dry-run"),
        ("train", "--preset", "olympiad", "--dry-run", "--processes", "8", "--set", "train.parallel=fsdp"),
        ("train", "--preset", "olympiad", "--processes", "8"), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "olympiad" in proc.stdout and "GiB" in proc.stdout
    assert sharded.returncode == 0, sharded.stderr
    assert "8 (fsdp)" in sharded.stdout and "/ 8 ranks" in sharded.stdout
    assert misused.returncode == 2 and misused.stderr.count("\n") == 1 and "--dry-run" in misused.stderr


# ---------------------------------------------------------------- a whole run
def test_run_writes_metrics_checkpoints_final_and_summary(tiny_qwen2, tmp_path):
    from transformers import AutoModelForCausalLM

    data = write_dataset(tmp_path / "train.jsonl")
    opts = tiny_overrides(tiny_qwen2, data, steps=2, **{"train.epochs": 2, "train.loss_agg": "token-mean",
                                                        "kl.estimator": "k3", "train.adv_norm": "batch"})
    proc = run(train_cmd(*opts, "--out", str(tmp_path / "run")))
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = tmp_path / "run"
    assert load_config(config_file=str(out / "config.yaml")).kl.estimator == "k3"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for key in ("reward/mean", "reward/std", "kl/value", "ema/distance", "loss/pg", "loss/kl", "clip/frac", "entropy",
                "grad/norm", "lr", "time/rollout", "time/update", "throughput/tokens_per_s", "steps/skipped"):
        assert key in rows[1], key
    assert "eval/anchor_accuracy" in rows[2] and "eval/accuracy" in rows[2] and "eval/accuracy" in rows[0]
    # the hf engine's sampling log-probs (KV-cached generate) vs the trainer's old-policy pass: float32 round-off
    assert 0 <= rows[1]["rollout/logprob_max_abs_diff"] < 1e-3 and rows[1]["rollout/ratio_mean"] == pytest.approx(1, abs=1e-3)
    assert rows[2]["ema/distance"] > 0 and rows[2]["steps/skipped"] == 0
    assert [r.get("ema/decay") for r in rows] == [None, 0.5, 0.5]  # a fixed eta is logged too (ema.decay)
    summary = json.loads((out / "summary.json").read_text())
    assert {"eval_accuracy_initial", "eval_accuracy_final", "steps", "wall_time_s"} <= summary.keys()
    # a CPU run records what makes its floating-point results reproducible (the tests' env: OMP_NUM_THREADS=1)
    assert summary["torch_threads"] == 1 and summary["cpu_capability"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_1", "step_2"]
    # final weights load with transformers; the anchor is float32 and differs from the policy
    anchor = AutoModelForCausalLM.from_pretrained(out / "final" / "anchor")
    assert next(anchor.parameters()).dtype == torch.float32
    pol, anc = load_weights(out / "final" / "policy"), load_weights(out / "final" / "anchor")
    assert any(not torch.equal(pol[k], anc[k]) for k in pol)


# ---------------------------------------------------------------- the olympiad preset, on CPU
def test_olympiad_preset_runs_two_steps_on_real_math_data(shared_data, tmp_path):
    """The real path at tiny size: chat template, the `math` reward, Top-k over the model's full vocabulary, bf16 policy."""
    pytest.importorskip("emapg_cli.rewards")
    from emapg_cli.models.tiny import save_tiny

    rows = json.loads((shared_data / "math" / "math_train.json").read_text())[:8]
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps({"id": f"m{i}", "question": r["problem"], "answer": r["answer"]}) + "\n"
                            for i, r in enumerate(rows)))
    model = save_tiny(tmp_path / "qwen2", arch="qwen2")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    opts = ["--preset", "olympiad"]
    for kv in (f"model.path={model}", f"data.train={data}", f"data.eval={data}", "data.eval_limit=2", "rollout.engine=hf",
               "rollout.prompts_per_step=2", "rollout.n=2", "rollout.max_new_tokens=8", "train.steps=2",
               "train.mini_batch_prompts=2", "train.micro_batch_size=4", "train.save_every=0", "eval.max_new_tokens=4",
               "kl.estimator=topk", f"kl.k={vocab}"):
        opts += ["--set", kv]
    proc = subprocess.run([sys.executable, "-m", "emapg_cli", "train", *opts, "--out", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 2 and math.isfinite(rows[-1]["kl/value"])


def test_rollout_mismatch_by_hand():
    from emapg_cli.train.metrics import rollout_mismatch

    m = rollout_mismatch(torch.tensor([-0.1, 0.0, 0.0]))  # trainer - engine, per token
    assert m["rollout/logprob_abs_diff"] == pytest.approx(0.1 / 3)
    assert m["rollout/logprob_max_abs_diff"] == pytest.approx(0.1)
    assert m["rollout/ratio_mean"] == pytest.approx((math.exp(-0.1) + 2) / 3)
    assert rollout_mismatch(None) == {} and rollout_mismatch(torch.zeros(0)) == {}


def test_micro_batches():
    """Consecutive slices of max_rows rows."""
    from emapg_cli.train.rollout import micro_batches

    assert [m.tolist() for m in micro_batches(torch.arange(5), 2)] == [[0, 1], [2, 3], [4]]


def test_removed_max_tokens_per_micro_batch():
    """Batching by tokens is gone: a run's config.yaml holding it off (null) still loads, for --resume; setting it is
    the one-line error naming the removal."""
    from emapg_cli.config.loading import load_config, validate
    from emapg_cli.errors import UserError

    assert validate({"train": {"max_tokens_per_micro_batch": None}}).train == load_config().train
    with pytest.raises(UserError, match="train.max_tokens_per_micro_batch .* is gone"):
        validate({"train": {"max_tokens_per_micro_batch": 4096}})
