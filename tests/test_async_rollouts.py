"""Asynchronous rollouts (rollout.max_staleness, train/async_rollouts.py), without a rollout server: the trainer's
engine factory is replaced by `LaggingEngine`, a versioned engine in this process (the hf engine on its own copy
of the policy) that keeps every pushed version and samples each request from the OLDEST version it may
(`SamplingParams.min_version`), so its weights lag the trainer's by exactly k updates, on purpose and
deterministically. max_staleness=0 stays bit-identical to the synchronous loop: tests/test_golden_weights.py.
"""

from __future__ import annotations

import copy
import json
import math
import threading
import time

import pytest
import torch

from emapg_cli.config.loading import load_config
from emapg_cli.engines.base import EngineBase
from emapg_cli.errors import UserError
from train_helpers import tiny_overrides, write_dataset


class LaggingEngine(EngineBase):
    """A versioned engine (`engines.base.Engine`) in this process: pushes are snapshots kept per version; a request
    is sampled from the current weights when they are at least its min_version, else from the oldest pushed version
    that is (applied under the generation lock, so never in the middle of a generation). A generation in the
    trainer's background thread is slow: it returns only once the next version was pushed (it outlasts the update)."""

    versioned = True
    records_topk = True

    def __init__(self, policy, tokenizer):
        from emapg_cli.engines.hf import HFEngine

        self.model = copy.deepcopy(policy).eval()  # its own weights: the trainer's module is never read
        self.hf = HFEngine(self.model, tokenizer)
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}  # version -> state dict
        self.weights_version = -1  # nothing pushed yet
        self.wait_s = 0.0
        self.calls: list[tuple] = []  # (min_version, version sampled from, thread name) per generate
        self.cond, self.lock = threading.Condition(), threading.Lock()
        self.overlaps = 0  # generate calls that arrived while another was running

    def push_weights(self, model, version: int) -> None:
        snap = {k: v.detach().clone() for k, v in model.state_dict().items()}
        with self.cond:
            self.snapshots[version] = snap
            self.cond.notify_all()

    def load_weights(self, model) -> None:
        self.push_weights(model, self.weights_version + 1)

    def full_vocab_logprobs(self, params) -> bool:
        return self.hf.full_vocab_logprobs(params)

    def generate(self, prompts, params):
        if not self.lock.acquire(blocking=False):  # the trainer sends one request at a time: count any overlap
            self.overlaps += 1
            self.lock.acquire()
        try:
            need = params.min_version if params.min_version is not None else self.weights_version
            newest = max(self.snapshots, default=-1)
            t0 = time.perf_counter()
            with self.cond:  # hold the request until a version >= need was pushed
                self.cond.wait_for(lambda: max(self.snapshots, default=-1) >= need, timeout=60)
            self.wait_s += time.perf_counter() - t0
            if self.weights_version < need:  # lag on purpose: the oldest version the request allows
                self.weights_version = min(v for v in self.snapshots if v >= need)
                self.model.load_state_dict(self.snapshots[self.weights_version])
            self.calls.append((params.min_version, self.weights_version, threading.current_thread().name))
            groups = self.hf.generate(prompts, params)
            for c in (c for g in groups for c in g):
                c.weights_version = self.weights_version
            if threading.current_thread() is not threading.main_thread():  # a slow engine: the background generation
                with self.cond:  # ends only after the update it overlaps has pushed its weights
                    self.cond.wait_for(lambda: max(self.snapshots) > newest, timeout=60)
                time.sleep(0.2)  # ... and a little later: what follows the push (an evaluation) must wait for it
            return groups
        finally:
            self.lock.release()


def _opts(tmp_path, model, **extra) -> list[str]:
    """tiny_overrides as load_config overrides (4 prompts x 4 responses of <= 6 tokens, 2 mini-batches: the
    old-policy pass runs), a rollout server URL the replaced factory never contacts, no checkpoint before the last."""
    opts = tiny_overrides(model, write_dataset(tmp_path / "train.jsonl"), **{
        "train.save_every": 0, "rollout.engine_url": "http://127.0.0.1:9", **extra})
    return opts[1::2]


def _train(tmp_path, model, monkeypatch, *opts, resume=False, stop_at=None):
    """Train in this process with a LaggingEngine; returns (metrics rows by step, the engine, the batches the update
    took after `correction_weights`, by step). `stop_at`: Ctrl-C as that step starts (KeyboardInterrupt raised)."""
    import emapg_cli.train.trainer as trainer_mod
    import emapg_cli.train.update as update_mod
    from train_launcher import install

    install()  # the test_digit reward: about a quarter of the tiny model's responses score, so the policy moves
    made, batches = [], []
    monkeypatch.setattr(trainer_mod, "make_rollout_engine",
                        lambda cfg, policy, tokenizer, weights_context=None: made.append(LaggingEngine(policy, tokenizer)) or made[-1])
    weights = update_mod.correction_weights

    def recorded(batch, loss):
        out = weights(batch, loss)
        batches.append(out[0])
        return out

    monkeypatch.setattr(update_mod, "correction_weights", recorded)
    cfg = load_config(overrides=list(opts))
    trainer = trainer_mod.Trainer(cfg, tmp_path / "run", resume=resume)
    if stop_at is not None:
        step = trainer.step
        trainer.step = lambda s: (_ for _ in ()).throw(KeyboardInterrupt) if s == stop_at else step(s)
        with pytest.raises(KeyboardInterrupt):
            trainer.run()
        assert trainer.pipeline.pending is None  # the in-flight generation was let go
    else:
        trainer.run()
    rows = {r["step"]: r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())}
    return rows, made[0], batches


def test_one_step_off_policy_runs_and_reports(tmp_path, tiny_qwen2, monkeypatch, one_torch_thread):
    """k = 1, 3 steps: step 1 is sampled from version 0 (nothing was in flight), steps 2 and 3 in the background
    from versions 0 and 1 (min_version = s - 1 - 1 = s - 2), so rollout/staleness = (s - 1) - version = 0, 1, 1.
    The policy's evaluations ask for the current version (0 before training, 2 after step 2, once step 3's generation
    is done, 3 after training); the anchor's (eval.anchor_every = 2) never goes to the engine."""
    opts = _opts(tmp_path, tiny_qwen2, **{"rollout.max_staleness": 1, "eval.every": 2})
    rows, engine, _ = _train(tmp_path, tiny_qwen2, monkeypatch, *opts)
    assert [rows[s]["rollout/staleness"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    assert [rows[s]["rollout/staleness_max"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    for s in (1, 2, 3):
        assert rows[s]["rollout/trainer_wait_s"] >= 0 and rows[s]["rollout/engine_wait_s"] >= 0
        assert rows[s]["rollout/is_ratio_mean"] > 0  # train.rollout_correction resolved to token_truncate
    assert "eval/anchor_accuracy" in rows[2] and "eval/accuracy" in rows[2] and "eval/accuracy" in rows[3]
    # (min_version, version sampled, thread): eval 0, step 1, steps 2 and 3 in the background, evals 2 and 3
    assert [c[:2] for c in engine.calls] == [(0, 0), (0, 0), (0, 0), (1, 1), (2, 2), (3, 3)]
    assert [c[2] == "emapg-rollouts" for c in engine.calls] == [False, False, True, True, False, False]
    assert sorted(engine.snapshots) == [0, 1, 2, 3]  # the setup push, then one version per step
    assert engine.overlaps == 0  # the evaluation after step 2 waited for step 3's generation (drain)


def test_lagging_engine_is_corrected(tmp_path, tiny_qwen2, monkeypatch, one_torch_thread):
    """k = 2: step 3 trains the policy of version 2 on samples of version 0 (staleness 2). Its correction weights
    are min(rho, C), rho = exp(l_old - l_sampling): l_old the trainer's old-policy pass (version 2), l_sampling the
    engine's record (version 0); C = train.rollout_correction_cap = 1. One token checked by hand, and both
    log-probs recomputed from the versions' own weights."""
    opts = _opts(tmp_path, tiny_qwen2, **{"rollout.max_staleness": 2, "train.rollout_correction_cap": 1.0, "eval.anchor_every": 0})
    rows, engine, batches = _train(tmp_path, tiny_qwen2, monkeypatch, *opts)
    assert [rows[s]["rollout/staleness"] for s in (1, 2, 3)] == [0.0, 1.0, 2.0]
    assert all(c[:2] == (0, 0) for c in engine.calls[:-1])  # every request of steps 1-3: min_version 0, version 0
    assert [c[2] == "emapg-rollouts" for c in engine.calls].count(True) == 2 and engine.overlaps == 0
    batch = batches[2]  # step 3
    mask = batch.policy_mask.bool()
    old, samp = batch.old_logp, batch.sampling_logp  # [B, R] float32
    # the token whose weights moved it most: rho far from 1 proves the lag reached the correction
    b, t = divmod(int(((old - samp).abs() * mask).argmax()), old.shape[1])
    l_old, l_s = float(old[b, t]), float(samp[b, t])
    rho = math.exp(l_old - l_s)  # e.g. on this machine l_old = -5.37, l_s = -5.61: rho = e^0.24 = 1.27
    assert abs(math.log(rho)) > 1e-3
    want = min(rho, 1.0)  # token_truncate with C = 1: 1.0 for rho = 1.27 (truncated), rho itself below 1
    assert float(batch.is_weight[b, t]) == pytest.approx(want, rel=1e-5)
    # every token: the weights the update used are min(exp(old - sampling), 1)
    torch.testing.assert_close(batch.is_weight[mask], (old - samp)[mask].exp().clamp(max=1.0), rtol=1e-6, atol=0)
    # the update's statistics (rollout/is_*) are those of the same rho (main process's tokens)
    rho_all = (old - samp)[mask].double().exp()
    assert rows[3]["rollout/is_ratio_mean"] == pytest.approx(float(rho_all.mean()), rel=1e-4)
    assert rows[3]["rollout/is_clipped_frac"] == pytest.approx(float((rho_all > 1).double().mean()), abs=1e-6)
    # recompute both from the versions' weights, on row b without its padding: the token at response position t
    # has its logits at sequence position p + t - 1 (p: the row's real prompt tokens)
    ids = batch.input_ids[b][batch.attention_mask[b].bool()]  # [p + r]
    p = int(batch.attention_mask[b, :batch.prompt_len].sum())
    model = copy.deepcopy(engine.model)
    for version, value in ((0, l_s), (2, l_old)):  # l_sampling under version 0, l_old under version 2
        model.load_state_dict(engine.snapshots[version])
        with torch.no_grad():
            logits = model(ids[None]).logits[0].float()  # [p + r, V]
        assert float(torch.log_softmax(logits[p + t - 1], -1)[ids[p + t]]) == pytest.approx(value, abs=1e-4)


@pytest.mark.slow  # two sessions of a tiny run, ~15 s (CI budget)
def test_interrupted_and_resumed(tmp_path, tiny_qwen2, monkeypatch, one_torch_thread):
    """k = 1, 4 steps, Ctrl-C as step 3 starts (its generation, from version 1, is in flight and dropped), resumed
    from the checkpoint of step 2: the resumed session pushes version 2 at setup and samples step 3 from it
    synchronously (staleness 0), step 4 in the background from version 2 again (min_version 2: staleness 1)."""
    opts = _opts(tmp_path, tiny_qwen2, **{"rollout.max_staleness": 1, "train.steps": 4, "train.save_every": 1,
                                          "eval.anchor_every": 0})
    rows, first, _ = _train(tmp_path, tiny_qwen2, monkeypatch, *opts, stop_at=3)
    assert sorted(rows) == [0, 1, 2] and [rows[s]["rollout/staleness"] for s in (1, 2)] == [0.0, 1.0]
    assert [c[:2] for c in first.calls] == [(0, 0), (0, 0), (0, 0), (1, 1)]  # eval, steps 1 and 2, step 3 (dropped)
    rows, engine, _ = _train(tmp_path, tiny_qwen2, monkeypatch, *opts, resume=True)
    assert sorted(rows) == [0, 1, 2, 3, 4] and [rows[s]["rollout/staleness"] for s in (3, 4)] == [0.0, 1.0]
    assert [c[:2] for c in engine.calls] == [(2, 2), (2, 2), (4, 4)]  # steps 3 and 4, the final evaluation
    assert (tmp_path / "run" / "final" / "policy").is_dir()


def test_config_refusals_and_defaults():
    """rollout.max_staleness >= 1: train.old_logprobs auto -> pass and train.rollout_correction unset ->
    token_truncate; refused (one line, a UserError: exit 2) without a versioned engine, with the engine's log-probs
    as the old policy, with search.retokenize and on several processes. 0 changes nothing."""
    from emapg_cli.train.preflight import config_checks, launch_problems

    default = load_config(overrides=[])
    assert (default.rollout.max_staleness, default.train.old_logprobs, default.train.rollout_correction) == (0, "auto", "none")
    url = "rollout.engine_url=http://127.0.0.1:8100"
    cfg = load_config(overrides=["rollout.max_staleness=1", url])
    assert (cfg.train.old_logprobs, cfg.train.rollout_correction) == ("pass", "token_truncate")
    config_checks(cfg)
    assert load_config(overrides=["rollout.max_staleness=1", url, "train.rollout_correction=none"]).train.rollout_correction == "none"
    for over, match in ((["rollout.max_staleness=1"], "needs a versioned engine"),
                        (["rollout.max_staleness=2", url, "train.old_logprobs=engine"], "not the current policy's"),
                        (["rollout.max_staleness=1", url, "search.enabled=true", "search.retokenize=true", "search.max_turns=2",
                          "rollout.max_new_tokens=500"], "search.retokenize")):
        with pytest.raises(UserError, match=match) as err:
            config_checks(load_config(overrides=over))
        assert "\n" not in str(err.value)
    assert any("one training process" in p for p in launch_problems(cfg, 2)) and not launch_problems(cfg, 1)
    with pytest.raises(Exception, match="max_staleness"):
        load_config(overrides=["rollout.max_staleness=-1"])


def test_pipeline_pieces():
    """The pure parts: the oldest version a step may sample from, and the staleness metrics (a multi-turn
    episode counts its oldest turn, engine_base.Completion.weights_version)."""
    from emapg_cli.agents.episode import add_policy_turn, new_episode
    from emapg_cli.engines.base import Completion
    from emapg_cli.train.async_rollouts import first_version, in_background, staleness_metrics

    # step 5, k = 2: the policy that trains is version 4, its samples may be 2 older: version 2; never below the start
    assert (first_version(5, 2, 0), first_version(2, 2, 0), first_version(5, 0, 0), first_version(5, 2, 3)) == (2, 0, 4, 3)
    ep = new_episode()
    add_policy_turn(ep, [1], [0.0], "a", "stop", version=3)
    add_policy_turn(ep, [2], [0.0], "b", "stop", version=2)  # a push landed between turns: the episode keeps 2
    comps = [Completion([1], "x", "stop", weights_version=4), Completion([1], "x", "stop", weights_version=3), ep]
    # step 5 trains version 4: lags 0, 1, 2 -> mean 1, max 2
    m = staleness_metrics(comps, 5, 0.5, 0.25)
    assert m == {"rollout/staleness": 1.0, "rollout/staleness_max": 2.0, "rollout/trainer_wait_s": 0.5, "rollout/engine_wait_s": 0.25}
    assert staleness_metrics([Completion([1], "x", "stop")], 5, 0.5, 0.0) == {}  # an unversioned engine: nothing
    with pytest.raises(UserError, match="boom"):  # an error in the thread is raised unchanged where the step waits
        in_background(lambda: (_ for _ in ()).throw(UserError("boom")), "t").result(timeout=10)
