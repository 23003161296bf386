"""Observation masking: tokens the policy did not sample get no loss, no KL, no entropy and no count in any term.

Two checks on a tiny Qwen2 with multi-turn rows (policy turns, observations in the middle, a trailing observation):
  * changing the observation tokens' log-probs (old policy, anchor, Top-k head, q indices, engine log-probs), or
    the ids of a trailing observation (its targets), leaves the loss and every gradient bit-identical, for each
    estimator family and each loss_agg mode;
  * the aggregated loss and the token counts of each loss_agg mode equal hand-computed values over policy tokens.
"""

from __future__ import annotations

import pytest
import torch

from emapg_cli.agents import Episode
from emapg_cli.config.loading import load_config
from emapg_cli.train.rollout import build_batch
from train_helpers import OneProcess, settings_of

# (policy, observation) segment lengths per row; row 3 ends with an observation (its targets are changed below)
SEGMENTS = [[("p", 3), ("o", 2), ("p", 4)], [("p", 2), ("o", 4), ("p", 1)], [("p", 5)], [("p", 2), ("o", 3), ("p", 2), ("o", 3)]]
MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
ESTIMATORS = [("k3", "reverse"), ("topk", "reverse"), ("topk", "forward"), ("topk_paper", "reverse"), ("exact", "reverse")]


@pytest.fixture(scope="module")
def lm(tiny_qwen2):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_qwen2)


def episodes(gen: torch.Generator, vocab: int) -> list[Episode]:
    out = []
    for row in SEGMENTS:
        ids, mask = [], []
        for kind, n in row:
            ids += torch.randint(3, vocab, (n,), generator=gen).tolist()
            mask += [kind == "p"] * n
        logprobs = [-1.0 if m else 0.0 for m in mask]
        out.append(Episode(token_ids=ids, text="", finish_reason="stop", logprobs=logprobs, policy_mask=mask))
    return out


def make_batch(lm, gen):
    vocab = lm.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (4, 6, 5, 3)]
    adv = torch.tensor([1.0, -0.5, 0.7, -1.2])
    return build_batch(prompts, episodes(gen, vocab), adv, pad_id=0)


def loss_and_grads(lm, anchor, batch, cfg):
    from emapg_cli.train.logprobs import TokenScorer
    from emapg_cli.train.update import micro_batch_loss

    scorer = TokenScorer(lm)
    mask = batch.policy_mask
    lm.zero_grad(set_to_none=True)
    parts = micro_batch_loss(scorer, batch, settings_of(cfg), float(mask.sum()), float(mask.shape[0]), anchor)
    parts.loss.backward()
    grads = [p.grad.detach().clone() for p in lm.parameters()]
    lm.zero_grad(set_to_none=True)
    return parts, grads


@pytest.mark.parametrize("estimator,direction", ESTIMATORS)
def test_observations_change_nothing(lm, estimator, direction):
    from emapg_cli.train.loading import make_anchor
    from emapg_cli.train.logprobs import TokenScorer
    from emapg_cli.train.passes import reference_passes

    gen = torch.Generator().manual_seed(0)
    anchor = make_anchor(lm)
    with torch.no_grad():  # an anchor away from the policy, so the KL terms are not 0
        for p in anchor.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    batch = make_batch(lm, gen)
    sampled = [p.detach().clone() for p in lm.parameters()]
    moved = [w + 1e-3 for w in sampled]  # the policy has moved since sampling: ratios != 1

    def use(weights):
        with torch.no_grad():
            for p, w in zip(lm.parameters(), weights):
                p.copy_(w)

    obs = batch.response_mask & ~batch.loss_mask  # [B, R] observation tokens
    assert int(obs.sum()) == 12 and int(batch.loss_mask.sum()) == 19  # 3+4, 2+1, 5, 2+2; observations 2, 4, 3+3
    for mode in MODES:
        # 2 mini-batches: the old-policy pass runs (ratio and importance weight are not identically 1)
        cfg = load_config(overrides=[f"kl.estimator={estimator}", f"kl.direction={direction}", "kl.k=4", "kl.coef=0.5",
                                     "rollout.prompts_per_step=2", "rollout.n=2", "train.mini_batch_prompts=1",
                                     f"train.loss_agg={mode}", "train.logit_chunk=7"])
        use(sampled)
        ref = reference_passes(TokenScorer(lm), TokenScorer(anchor), batch, settings_of(cfg))
        use(moved)
        base, g0 = loss_and_grads(lm, anchor, ref, cfg)

        # 1. observation log-probs replaced by arbitrary finite values
        def scramble(t, scale=3.0):
            if t is None:
                return None
            noise = (torch.randint(0, 4, t.shape, generator=gen) if t.dtype == torch.long
                     else scale * torch.randn(t.shape, generator=gen) - 2.0)
            m = obs.reshape(*obs.shape, *([1] * (t.dim() - 2)))
            return torch.where(m, noise.to(t.dtype), t)

        changed = ref.with_(old_logp=scramble(ref.old_logp), ref_logp=scramble(ref.ref_logp),
                            ref_logp_q=scramble(ref.ref_logp_q), q_index=scramble(ref.q_index),
                            sampling_logp=scramble(ref.sampling_logp))
        assert not torch.equal(changed.old_logp, ref.old_logp)
        parts, g1 = loss_and_grads(lm, anchor, changed, cfg)
        assert torch.equal(parts.loss, base.loss), (mode, "log-probs")
        assert all(torch.equal(a, b) for a, b in zip(g0, g1)), (mode, "log-probs")
        assert parts.tokens == base.tokens == 19.0 and parts.entropy_sum == base.entropy_sum

        # 2. the trailing observation's tokens (targets) changed, passes re-run on the changed sequence
        ids = batch.input_ids.clone()
        tail = batch.prompt_len + torch.nonzero(obs[3]).squeeze(-1)[-3:]
        ids[3, tail] = (ids[3, tail] + 5) % lm.config.vocab_size
        use(sampled)
        ref2 = reference_passes(TokenScorer(lm), TokenScorer(anchor), batch.with_(input_ids=ids), settings_of(cfg))
        use(moved)
        parts, g2 = loss_and_grads(lm, anchor, ref2, cfg)
        assert torch.equal(parts.loss, base.loss), (mode, "targets")
        assert all(torch.equal(a, b) for a, b in zip(g0, g2)), (mode, "targets")
    use(sampled)


@pytest.mark.parametrize("mode,expected", [
    # rows: policy tokens 3 and 2 (observations 2 and 4); one on-policy pass, so ratio = 1 and pg_tok = -A per token
    # A = [1, -3]: row sums -1*3 = -3 and 3*2 = 6
    ("token-mean", (-3 + 6) / 5),                  # sum / N_policy_tokens = 3/5 = 0.6 (with observations: 3/11)
    ("seq-mean-token-mean", (-3 / 3 + 6 / 2) / 2),  # (-1 + 3)/2 = 1.0 (with observations: (-3/5 + 6/6)/2 = 0.2)
    ("seq-mean-token-sum", (-3 + 6) / 2),          # 3/2 = 1.5 (observations add nothing: they have no value)
])
def test_masked_aggregation_hand_computed(lm, mode, expected):
    from emapg_cli.train.logprobs import TokenScorer
    from emapg_cli.train.parallel import Replicated
    from emapg_cli.train.setup import make_scheduler
    from emapg_cli.train.update import update_policy

    gen = torch.Generator().manual_seed(1)
    vocab = lm.config.vocab_size
    eps = [Episode(token_ids=torch.randint(3, vocab, (n,), generator=gen).tolist(), text="", finish_reason="stop",
                   logprobs=None, policy_mask=m)
           for n, m in ((5, [True, True, False, False, True]), (6, [False, True, True, False, False, False]))]
    batch = build_batch([[5, 6, 7], [8, 9]], eps, torch.tensor([1.0, -3.0]), pad_id=0)
    cfg = load_config(overrides=["rollout.prompts_per_step=1", "rollout.n=2", "train.mini_batch_prompts=1",
                                 "train.micro_batch_size=1", f"train.loss_agg={mode}", "kl.coef=0"])
    opt = torch.optim.SGD(lm.parameters(), lr=0.0)
    stats = update_policy(Replicated(OneProcess()), TokenScorer(lm), batch, settings_of(cfg), opt, make_scheduler(opt, cfg),
                          torch.Generator().manual_seed(0))
    assert stats.pg[0] == pytest.approx(expected, abs=1e-6)
    assert stats.tokens == 5.0  # entropy and clip fractions are over the 5 policy tokens
    lm.zero_grad(set_to_none=True)


SCRIPTED_ENV = '''
class Scripted:
    """Plays back the observations in the example's meta (None ends the episode)."""
    max_turns = 3

    def __init__(self, example):
        self.obs = list(example["meta"]["obs"])

    def step(self, text):
        return self.obs.pop(0)
'''


class IdTokenizer:
    """Text is the token ids written out: `decode` joins them, encoding splits them (so observations are exact ids)."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [int(x) for x in text.split()]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"{i} " for i in ids)


def test_environment_episodes_are_the_hand_built_trajectories(lm, tmp_path):
    """A user environment (rollout.env=FILE.py:Class) run by the multi-turn loop on a scripted engine gives exactly
    hand-built episodes of `test_observations_change_nothing`'s layout (`episodes`: the same SEGMENTS, ids, mask,
    log-probs) and the same batch tensors, so that test's proof (observation tokens change no loss, KL, entropy or
    gradient) holds for environment episodes."""
    from emapg_cli.agents.environments import generate, make_environment
    from emapg_cli.data.schema import Example
    from emapg_cli.engines.base import Completion, SamplingParams

    gen = torch.Generator().manual_seed(0)
    vocab = lm.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (4, 6, 5, 3)]
    hand = episodes(gen, vocab)
    turns, observations = [], []  # per row: the policy segments' ids; the observations' texts (then None: the end)
    for row, ep in zip(SEGMENTS, hand):
        at, ts, obs = 0, [], []
        for kind, n in row:
            part = ep.token_ids[at:at + n]
            at += n
            (ts if kind == "p" else obs).append(part if kind == "p" else "".join(f"{i} " for i in part))
        turns.append(ts)
        observations.append(obs + [None] * (len(ts) - len(obs)))

    class Engine:
        def __init__(self):
            self.turn = [0] * len(prompts)

        def generate(self, contexts, params):
            out = []
            for c in contexts:
                row = next(i for i, p in enumerate(prompts) if c[:len(p)] == p)
                ids = turns[row][self.turn[row]]
                self.turn[row] += 1
                out.append([Completion(ids, "", "stop", [-1.0] * len(ids))])
            return out

    path = tmp_path / "scripted_env.py"
    path.write_text(SCRIPTED_ENV)
    # context limit 17 with 5-token turns: row 3 (prompt 3) has 3 + 10 + 5 = 18 > 17 tokens before a third turn,
    # so it ends on its trailing observation; row 1 (prompt 6) still fits its second turn: 6 + 6 + 5 = 17
    env = make_environment(f"{path}:Scripted", IdTokenizer(), max_context_tokens=17, timeout_s=5)
    exs = [Example(id=f"r{i}", question="q", answers=["a"], meta={"obs": o}) for i, o in enumerate(observations)]
    got = [g[0] for g in generate(env.bind(Engine()), prompts, SamplingParams(max_new_tokens=5), exs)]
    for a, b in zip(got, hand):
        assert (a.token_ids, a.policy_mask, a.logprobs) == (b.token_ids, b.policy_mask, b.logprobs)
    assert [e.outcome for e in got] == ["done", "done", "done", "context"]
    adv = torch.tensor([1.0, -0.5, 0.7, -1.2])
    x, y = build_batch(prompts, got, adv, pad_id=0), build_batch(prompts, hand, adv, pad_id=0)
    for name in ("input_ids", "attention_mask", "response_mask", "loss_mask", "sampling_logp"):
        assert torch.equal(getattr(x, name), getattr(y, name)), name
    assert int((x.response_mask & ~x.loss_mask).sum()) == 12  # the observation tokens: 2 + 4 + 3 + 3, mask 0
