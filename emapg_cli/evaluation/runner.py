"""`emapg eval`: sample n responses per problem, grade them, write results and the summary; resumable.

Generation and grading overlap: while the engine samples chunk k+1, a background thread grades
chunk k (grading runs in worker processes, so the thread mostly waits on pipes) and appends its
rows to results.jsonl. Each chunk is one `generate` call with n samples per prompt and distinct
per-sample seeds (see the engines).
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from emapg_cli.data.schema import Example, read_jsonl
from emapg_cli.datasets.loading import load_examples
from emapg_cli.errors import UserError
from emapg_cli.evaluation.metrics import ItemScores, by_subset, candidate_pairs, candidates, equivalence_votes, summarize
from emapg_cli.evaluation.report import write_report
from emapg_cli.evaluation.store import RESULTS, append_results, open_run
from emapg_cli.grading import MAX_ANSWER_CHARS
from emapg_cli.rewards.shaping import is_truncated

#: progress(items done, items total, accuracy so far over all graded responses)
Progress = Callable[[int, int, float], None]


@dataclass(frozen=True)
class EvalSettings:
    """Everything one evaluation run depends on (recorded in run.json)."""

    bench: str
    out: Path
    model: Optional[str] = None
    responses_file: Optional[Path] = None
    backend: str = "auto"
    n: int = 32
    temperature: float = 0.8
    top_p: float = 0.9
    max_tokens: int = 28000
    seed: int = 429
    limit: Optional[int] = None
    instruction: Optional[str] = None
    chunk: Optional[int] = None
    max_model_len: Optional[int] = None
    dtype: Optional[str] = None
    gpu_memory_utilization: float = 0.9
    grader_workers: Optional[int] = None
    grader_timeout: float = 5.0
    reward: str = "math"  # a reward name or plugin, as rollout.reward (rewards/graders.py): math, em, f1, FILE.py:fn, ...
    retriever: Optional[str] = None  # bm25:DIR, dense:DIR or http://HOST:PORT: answer with the search agent (evaluation/search.py)
    env: Optional[str] = None  # rollout.env's choices (agents/environments.py); None: search with a retriever, else single
    max_turns: Optional[int] = 4  # search turns (then one final turn without search); a user environment's (None: its own)
    topk: int = 3  # passages per search
    max_obs_tokens: int = 500  # observation token limit
    max_context_tokens: int = 4096  # prompt + trajectory token limit
    prompt_template: Optional[str] = None  # user-message template file (None: Search-R1's prompt)
    truncated: str = "zero"  # reward.truncated: a response cut at the token cap scores 0 (`zero`) or is graded (`grade`)
    env_timeout_s: float = 10.0  # rollout.env_timeout_s: seconds one call into a user environment may take
    plugin_memory_mib: Optional[int] = None  # reward.plugin_memory_mib: a reward plugin's worker memory cap (None: default)
    agent: Optional[str] = None  # rollout.agent (docs/agents.md): FILE.py:fn answers each problem on an OpenAI client
    agent_max_calls: int = 16  # rollout.agent_max_calls
    agent_max_tokens: int = 16384  # rollout.agent_max_tokens
    agent_timeout_s: float = 300.0  # rollout.agent_timeout_s
    agent_workers: int = 64  # rollout.agent_workers
    agent_max_failure_rate: float = 0.5  # more failed episodes in a generated chunk stop the evaluation (one line)
    think: str = "emapg"  # grading.think: where the answer is looked for (grading/extract.py)
    chat_prefix: Optional[list] = None  # data.chat_prefix: chat turns ({role, content}) before each question (None: none)
    stop: Optional[list] = None  # rollout.stop: extra stop strings, as training's evaluation stops (None: EOS only)

    @property
    def env_name(self) -> str:
        """The environment the model answers in: --env, else search with --retriever, else single (also with --agent)."""
        return self.env or ("search" if self.retriever else "single")

    def agent_settings(self):
        """--agent's `agents.agent.AgentSettings` (None without one)."""
        from emapg_cli.agents.agent import AgentSettings

        return None if self.agent is None else AgentSettings(
            ref=self.agent, max_calls=self.agent_max_calls, max_tokens=self.agent_max_tokens, timeout_s=self.agent_timeout_s,
            workers=self.agent_workers, max_failure_rate=self.agent_max_failure_rate)

    def record(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self).items()}


def load_responses(path: Path, examples: Sequence[Example]) -> tuple[list[Example], dict[str, list[str]], dict[str, list]]:
    """Given responses {"id", "responses"[, "finish_reasons"]} matched to the bench's items (in bench order).

    Returns (items, responses by id, finish reasons by id: "length" marks a truncated response)."""
    given: dict[str, list[str]] = {}
    reasons: dict[str, list] = {}
    for i, row in read_jsonl(path, numbered=True):
        responses = row.get("responses")
        if "id" not in row or not isinstance(responses, list) or not responses or not all(isinstance(r, str) for r in responses):
            raise UserError(f"{path}:{i}: rows must be {{\"id\": ..., \"responses\": [str, ...]}}")
        rid = str(row["id"])
        if rid in given:
            raise UserError(f"{path}:{i}: duplicate id {rid!r} (each item's responses must be in one row)")
        fr = row.get("finish_reasons")
        if fr is not None and (not isinstance(fr, list) or len(fr) != len(responses)):
            raise UserError(f"{path}:{i}: finish_reasons must be a list as long as responses")
        if given and len(responses) != len(first := next(iter(given.values()))):  # pass@k, maj@n need one n for all items
            raise UserError(f"{path}:{i}: {len(responses)} responses, but the first row has {len(first)} "
                            "(every item needs the same number of responses)")
        given[rid] = responses
        reasons[rid] = fr if fr is not None else [None] * len(responses)
    known = {ex.id for ex in examples}
    unknown = [i for i in given if i not in known]
    if unknown:
        raise UserError(f"{path}: {len(unknown)} ids are not in the bench (e.g. {', '.join(unknown[:3])})")
    return [ex for ex in examples if ex.id in given], given, reasons


def _item_scores(ex: Example, row: dict[str, Any], key: Callable[[str], str]) -> ItemScores:
    """An item's graded samples; `key` is the grader's vote key (for rows without "votes", of older versions)."""
    # over-long answers (rows of older versions may hold them) never vote: strict_key stays bounded
    votes = row.get("votes") or [key(e) if e is not None and len(e) <= MAX_ANSWER_CHARS else None for e in row["extracted"]]
    return ItemScores(row["correct"], row["strict"], votes, ex.meta.get("subset"), row.get("classes"))


class _Grading:
    """Grades chunks and appends their rows, counting what the summary reports."""

    def __init__(self, grader: Any, results: Path, done: dict[str, dict], total: int, progress: Optional[Progress],
                 truncated: str = "zero"):
        self.grader, self.results, self.done, self.total, self.progress = grader, results, done, total, progress
        self.zero_truncated = truncated == "zero"
        self.vote_key = grader.vote_key  # maj@n's vote of an extracted answer
        self.responses = sum(len(r["correct"]) for r in done.values())
        self.correct = sum(sum(r["correct"]) for r in done.values())
        self.seconds = 0.0
        self.graded = 0

    def __call__(self, items: Sequence[Example], groups: Sequence[Sequence[str]], extra: Sequence[dict]) -> None:
        t0 = time.perf_counter()
        flat = [r for g in groups for r in g]
        examples = [ex for ex, g in zip(items, groups) for _ in g]
        own = [more.get("env_rewards") for more in extra]
        if own and all(o is not None for o in own):  # the environment's own reward(text), instead of --reward
            from emapg_cli.rewards.graders import FULL_SCORE, ScoreGrade

            grades = iter([ScoreGrade(None, r >= FULL_SCORE, r >= FULL_SCORE, r) for o in own for r in o])
            extra = [{k: v for k, v in more.items() if k != "env_rewards"} for more in extra]
        else:
            grades = iter(self.grader.grade(flat, examples))
        rows = []
        for ex, group, more in zip(items, groups, extra):
            gs = [next(grades) for _ in group]
            # a truncated response (finish_reason "length") scores 0 and casts no vote under reward.truncated=zero
            cut = [self.zero_truncated and is_truncated(fr) for fr in (more.get("finish_reasons") or [None] * len(group))]
            rows.append({
                "id": ex.id,
                "responses": list(group),
                "extracted": [g.extracted for g in gs],
                "correct": [g.correct and not c for g, c in zip(gs, cut)],
                "strict": [g.strict and not c for g, c in zip(gs, cut)],
                "votes": [None if g.extracted is None or c else self.vote_key(g.extracted) for g, c in zip(gs, cut)],
                **({"scores": [0.0 if c else g.score for g, c in zip(gs, cut)]} if gs and hasattr(gs[0], "score") else {}),
                **more,
            })
        self._classes(rows)
        append_results(self.results, rows)
        self.seconds += time.perf_counter() - t0
        self.graded += len(flat)
        for row in rows:
            self.done[row["id"]] = row
            self.responses += len(row["correct"])
            self.correct += sum(row["correct"])
        if self.progress:
            self.progress(len(self.done), self.total, self.correct / max(self.responses, 1))


    def _classes(self, rows: list[dict]) -> None:
        """rows[i]["classes"]: each vote's mathematical-equivalence class (maj@n), from one pooled batch of
        pairwise math-verify comparisons between each item's most frequent distinct answers."""
        pairs, spans = [], []
        for row in rows:
            cands = candidates(row["votes"])
            answer = {}  # a candidate's first extracted answer
            for key, text in zip(row["votes"], row["extracted"]):
                answer.setdefault(key, text)
            first = len(pairs)
            pairs += [(answer[cands[i]], answer[cands[j]]) for i, j in candidate_pairs(cands)]
            spans.append((cands, first, len(pairs)))
        same = self.grader.equivalent(pairs) if pairs else []
        for row, (cands, a, b) in zip(rows, spans):
            row["classes"] = equivalence_votes(row["votes"], cands, same[a:b])


def check_prompts_fit(prompt_lengths: Sequence[int], max_tokens: int, max_context_tokens: int) -> int:
    """A multi-turn episode starts a turn only when prompt + a full --max-tokens turn fit in --max-context-tokens
    (training's check of search.max_context_tokens / rollout.max_context_tokens against data.max_prompt_tokens, with
    the real prompts in its place). When no prompt fits, a one-line UserError (the evaluation could only score 0).
    When some do not, one warning on stderr with their count: those items end before their first turn and score 0
    (an empty response, counted in the summary like any wrong answer), as training skips prompts over
    data.max_prompt_tokens. Returns how many prompts do not fit."""
    over = sum(n + max_tokens > max_context_tokens for n in prompt_lengths)
    if prompt_lengths and over == len(prompt_lengths):
        shortest = min(prompt_lengths)
        raise UserError(f"--max-context-tokens ({max_context_tokens}) must hold a prompt + --max-tokens ({max_tokens}, "
                        f"per turn), or no turn could start: none of the {len(prompt_lengths)} prompts fits (the "
                        f"shortest has {shortest} tokens)")
    if over:
        print(f"warning: {over} of {len(prompt_lengths)} prompts do not fit --max-context-tokens ({max_context_tokens}) "
              f"with --max-tokens ({max_tokens}, per turn): they get no turn and score 0", file=sys.stderr)
    return over


def _generate_all(s: EvalSettings, backend: str, todo: Sequence[Example], index_of: dict[str, int], grade: _Grading) -> dict[str, Any]:
    """Sample every item of `todo` in chunks, handing each chunk to `grade` in the background."""
    from emapg_cli.agents.environments import generate, make_environment
    from emapg_cli.engines import make_engine
    from emapg_cli.engines.base import SamplingParams
    from emapg_cli.engines.base import derive_seed
    from emapg_cli.models.loading import load_tokenizer
    from emapg_cli.models.prompts import render_prompt

    tokenizer = load_tokenizer(s.model)
    engine = make_engine(
        backend, s.model, seed=s.seed, dtype=s.dtype, max_model_len=s.max_model_len,
        gpu_memory_utilization=s.gpu_memory_utilization,
    )
    suffix = f"\n\n{s.instruction}" if s.instruction else ""
    from emapg_cli.config.models import SearchConfig
    from emapg_cli.evaluation.search import episode_extra, parse_retriever

    search = None if not s.retriever else SearchConfig(
        enabled=True, topk=s.topk, max_obs_tokens=s.max_obs_tokens, max_context_tokens=s.max_context_tokens,
        prompt_template=s.prompt_template, **parse_retriever(s.retriever))
    # the factory training uses (rollout.env): single-turn, the search agent, or a user environment
    env = make_environment(s.env_name, tokenizer, max_turns=s.max_turns if s.env_name != "single" else None,
                           search=search, max_context_tokens=s.max_context_tokens, timeout_s=s.env_timeout_s,
                           agent=s.agent_settings())
    message = env.user_message()
    generator = env.bind(engine)
    size = s.chunk or (512 if backend == "vllm" else max(1, 64 // s.n))  # vLLM batches itself; ~64 sequences for hf
    gen_seconds, tokens, truncated = 0.0, 0, 0
    pending: Optional[Future] = None
    rendered = [render_prompt(tokenizer, message(ex.question + suffix) if message else ex.question + suffix, s.chat_prefix or ())
                for ex in todo]
    if env.multi_turn:
        check_prompts_fit([len(p) for p in rendered], s.max_tokens, s.max_context_tokens)
    with ThreadPoolExecutor(max_workers=1) as background:
        for start in range(0, len(todo), size):
            items = todo[start : start + size]
            prompts = rendered[start : start + size]
            # Seeded by the chunk's first item: per-sample seeds never repeat across chunks.
            params = SamplingParams(
                n=s.n, max_new_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, stop=tuple(s.stop or ()),
                seed=derive_seed(s.seed, index_of[items[0].id]) % 2**31,
            )
            t0 = time.perf_counter()
            completions = generate(generator, prompts, params, items)
            gen_seconds += time.perf_counter() - t0
            if s.agent is not None:  # agent/* of the chunk; too many failed episodes stop the evaluation (one line)
                env.metrics([c for g in completions for c in g], "of this chunk")
            tokens += sum(len(c.token_ids) for g in completions for c in g)
            truncated += sum(c.finish_reason == "length" for g in completions for c in g)
            if pending is not None:
                pending.result()  # surface a grading error before queueing more
            groups = [[c.text for c in g] for g in completions]
            extra = [{"num_tokens": [len(c.token_ids) for c in g], "finish_reasons": [c.finish_reason for c in g],
                      **(episode_extra(tokenizer, env, g) if env.multi_turn else {})} for g in completions]
            pending = background.submit(grade, items, groups, extra)
        if pending is not None:
            pending.result()
    env.close()
    return {
        "generation_time_s": gen_seconds,
        "generated_tokens": tokens,
        "tokens_per_s": tokens / gen_seconds if gen_seconds > 0 else None,
        "truncated_responses": truncated,
    }


def run_eval(s: EvalSettings, progress: Optional[Progress] = None) -> dict[str, Any]:
    """Evaluate `s.model` (or grade `s.responses_file`) on `s.bench`; returns the summary (also written)."""
    from emapg_cli.engines import resolve_backend

    t_start = time.perf_counter()
    if (s.model is None) == (s.responses_file is None):
        raise UserError("give exactly one of --model (generate) and --responses (grade given responses)")
    if s.env_name != "single":
        from emapg_cli.evaluation.search import check_turn_budget

        check_turn_budget(s.max_tokens, s.max_context_tokens)
    examples = load_examples(s.bench)[: s.limit]
    given: dict[str, list[str]] = {}
    if s.responses_file is not None:
        examples, given, reasons = load_responses(s.responses_file, examples)
    if not examples:
        raise UserError(f"nothing to evaluate: no items in '{s.bench}'" + (" match the given responses" if given else ""))
    if s.model is not None:  # a hub id offline and not cached: one line naming it now, not a minute of retries later
        from emapg_cli.models.hub import check_model_source

        check_model_source(s.model, "--model")
    backend = resolve_backend(s.backend) if s.model else "none"
    done = open_run(s.out, {**s.record(), "backend": backend})
    resumed = sum(ex.id in done for ex in examples)
    todo = [ex for ex in examples if ex.id not in done]

    gen_stats: dict[str, Any] = {"generation_time_s": 0.0, "generated_tokens": 0, "tokens_per_s": None, "truncated_responses": 0}
    from emapg_cli.rewards.graders import get_grader

    # the rewards registry, as in training: a registered name or a plugin (rewards/graders.py)
    with get_grader(s.reward, think=s.think, workers=s.grader_workers, timeout=s.grader_timeout, memory_mib=s.plugin_memory_mib) as grader:
        grading = _Grading(grader, s.out / RESULTS, done, len(examples), progress, s.truncated)
        if progress:
            progress(resumed, len(examples), grading.correct / max(grading.responses, 1))
        if todo and s.responses_file is not None:
            for start in range(0, len(todo), 64):
                items = todo[start : start + 64]
                grading(items, [given[ex.id] for ex in items], [{"finish_reasons": reasons[ex.id]} for ex in items])
        elif todo:
            index_of = {ex.id: i for i, ex in enumerate(examples)}
            gen_stats = _generate_all(s, backend, todo, index_of, grading)
        timeouts, refused, stats = grader.timeouts, grader.refused, grader.pool_stats
        version, votes, vote_key = grader.version, grader.votes, grader.vote_key
    from emapg_cli.agents.environments import grades_itself
    from emapg_cli.rewards.registry import canonical_reward

    reward = s.reward
    if s.model is not None and s.agent is not None:  # the agent's own reward graded every response
        reward, version, votes = f"rollout.agent {s.agent}", f"agent {s.agent}", False
    elif s.model is not None and grades_itself(s.env_name):  # the environment's own reward(text) graded every response: say so, and no votes
        reward, version, votes = f"{s.env_name}.reward", f"environment {s.env_name}.reward", False

    t_scores = time.perf_counter()
    scores = [_item_scores(ex, done[ex.id], vote_key) for ex in examples]
    grading.seconds += time.perf_counter() - t_scores  # normalising the votes is grading work too
    mean_score = None
    if canonical_reward(s.reward) != "math" or s.env_name not in ("single", "search") or s.agent is not None:  # the reward itself (f1 is partial credit; avg@n counts full scores only; an environment's own)
        per_item = [sum(done[ex.id]["scores"]) / len(done[ex.id]["scores"]) for ex in examples if "scores" in done[ex.id]]
        mean_score = sum(per_item) / len(per_item) if per_item else None
    summary = {
        "bench": s.bench,
        "model": s.model if s.model else f"responses:{s.responses_file}",
        "backend": backend,
        **summarize(scores, votes),
        "subsets": by_subset(scores, votes),
        # per data source, when the bench mixes several (items regrouped by Example.source)
        "sources": by_subset([replace(sc, subset=ex.source) for sc, ex in zip(scores, examples)], votes)
        if len({ex.source for ex in examples}) > 1 else {},
        "sampling": None if s.model is None else {
            "n": s.n, "temperature": s.temperature, "top_p": s.top_p, "max_tokens": s.max_tokens, "seed": s.seed,
            **({"retriever": s.retriever, "max_turns": s.max_turns, "topk": s.topk} if s.retriever else {}),
            **({"env": s.env_name, "max_turns": s.max_turns} if s.env_name not in ("single", "search") else {}),
            **({"agent": s.agent} if s.agent is not None else {}),
        },
        "instruction": s.instruction,
        "reward": reward,
        "mean_score": mean_score,
        "truncated": s.truncated,
        "think": s.think,
        "grader_version": version,
        "grader_timeouts": timeouts,
        "grader_refused": refused,
        "grader_errors": stats.errors,
        "grader_out_of_memory": stats.out_of_memory,
        "grader_crashes": stats.crashes,
        "resumed_items": resumed,
        "wall_time_s": time.perf_counter() - t_start,
        "grading_time_s": grading.seconds,
        "graded_per_s": grading.graded / grading.seconds if grading.seconds > 0 else None,
        **gen_stats,
    }
    if s.env_name not in ("single", "search") or s.agent is not None:
        from emapg_cli.evaluation.search import env_summary

        summary["env"] = env_summary(s.agent or s.env_name, examples, done)
    if s.retriever or s.reward in ("em", "f1"):
        from emapg_cli.evaluation.search import search_summary

        summary["search"] = search_summary(examples, done)
    write_report(s.out, summary)
    return summary
