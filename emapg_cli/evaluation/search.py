"""`emapg eval --retriever ...`: the search agent's loop as an evaluation (Search-R1's validation protocol); and the
results fields of any multi-turn environment (`--env`).

The same `SearchAgent` the trainer uses, built by the same factory (agents/environments.py), runs each question (greedy by default: Search-R1 validates
with T = 0), and each results row keeps every sample's full trajectory: its searches, the ids of
the passages each search showed, the final answer and the episode's counts. The summary adds
exact match and F1 (both computed from the extracted answers, so a resumed run reports the same
numbers), searches per question, the invalid-action rate and a per-data-source breakdown.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Optional, Sequence
from urllib.parse import urlparse

from emapg_cli.data.schema import Example
from emapg_cli.errors import UserError


def parse_retriever(spec: str) -> dict[str, Any]:
    """`bm25:DIR`, `dense:DIR` or `http://HOST:PORT[/retrieve]` (several, comma-separated) as `SearchConfig` fields
    (retriever, index | url)."""
    for kind in ("bm25", "dense"):
        if spec.startswith(f"{kind}:"):
            index = spec[len(kind) + 1:]
            if not index:
                raise UserError(f"--retriever {kind}:DIR needs the index folder (`emapg retriever index CORPUS --out DIR`)")
            return {"retriever": kind, "index": index}
    urls = []
    for one in spec.split(","):  # several servers: http://A,http://B (search.url as a list)
        parsed = urlparse(one)
        if parsed.scheme in ("http", "https") and parsed.netloc:
            urls.append(one if parsed.path not in ("", "/") else one.rstrip("/") + "/retrieve")
    if urls and len(urls) == len(spec.split(",")):
        return {"retriever": "http", "url": urls[0] if len(urls) == 1 else urls}
    raise UserError(f"--retriever must be bm25:DIR, dense:DIR or http://HOST:PORT (a Search-R1 /retrieve server), got '{spec}'")


def check_turn_budget(max_tokens: int, max_context_tokens: int) -> None:
    """With --retriever, --max-tokens is each turn's budget and a turn starts only when prompt + trajectory + a full
    turn fit in --max-context-tokens: a budget that leaves no room for a prompt would end every episode before its
    first turn (all scored 0). The same rule as the training config's search.max_context_tokens check."""
    if max_tokens >= max_context_tokens:
        raise UserError(f"--max-tokens ({max_tokens}, per turn with --retriever) must be below --max-context-tokens "
                        f"({max_context_tokens}) with room for the prompt, or every episode ends before its first turn")


def episode_extra(tokenizer, env, group) -> dict[str, Any]:
    """The results-row fields of one item's episodes in a multi-turn environment: the search agent's full
    trajectories (searches, passages shown, answer, counts, text), or a user environment's episodes (turns, calls,
    invalid, outcome, text) and its own rewards (`env_rewards`, graded instead of --reward; not written)."""
    from emapg_cli.agents import protocol

    if env.name == "search":
        return {"trajectories": [{
            "queries": e.queries,
            "retrieved_ids": e.retrieved,
            "answer": protocol.last_answer(e.text),
            "outcome": e.outcome,
            "turns": e.turns,
            "searches": e.searches,
            "invalid": e.invalid,
            "text": tokenizer.decode(e.token_ids, skip_special_tokens=False),
        } for e in group]}
    if env.name == "agent":  # an agent's episodes: its calls, sequences and failure, each sequence's text
        return {"episodes": [{"turns": e.turns, "calls": e.requests, "invalid": 0, "outcome": e.outcome, "error": e.error,
                              "prefix_breaks": e.prefix_breaks, "seconds": round(e.seconds, 3),
                              "text": [tokenizer.decode(seg.prompt + seg.episode.token_ids, skip_special_tokens=False)
                                       for seg in e.segments]} for e in group],
                "env_rewards": [e.env_reward for e in group]}
    out: dict[str, Any] = {"episodes": [{"turns": e.turns, "calls": e.calls, "invalid": e.invalid, "outcome": e.outcome,
                                         "text": tokenizer.decode(e.token_ids, skip_special_tokens=False)} for e in group]}
    if env.has_reward:
        out["env_rewards"] = [e.env_reward for e in group]
    return out


def env_summary(name: str, examples: Sequence[Example], rows: dict[str, dict]) -> dict[str, Any]:
    """A user environment's (or an agent's) means over its episodes: turns and calls per episode, the invalid-turn rate
    (an agent's: failed episodes, prefix breaks per episode)."""
    eps = [e for ex in examples for e in rows[ex.id].get("episodes", [])]
    turns = sum(e["turns"] for e in eps)
    out = {"name": name, "episodes": len(eps), "turns": turns / max(len(eps), 1),
           "calls": sum(e["calls"] for e in eps) / max(len(eps), 1),
           "invalid_rate": sum(e["invalid"] for e in eps) / max(turns, 1)}
    if eps and "error" in eps[0]:  # an agent's (--agent): failed episodes (scored 0) and prefix breaks per episode
        out.update(errors=sum(bool(e["error"]) for e in eps), prefix_breaks=sum(e["prefix_breaks"] for e in eps) / len(eps))
    return out


def search_summary(examples: Sequence[Example], rows: dict[str, dict]) -> dict[str, Any]:
    """Exact match, F1, searches per question, invalid-action rate and turns, overall and per data source.

    Means over samples (n per item); items without trajectories (graded --responses) count only for EM/F1.
    """
    from emapg_cli.rewards.qa import em_score, f1_score

    groups: dict[str, list[tuple[Example, dict]]] = defaultdict(list)
    for ex in examples:
        groups[ex.source or "-"].append((ex, rows[ex.id]))

    def answers(r: dict) -> list[Optional[str]]:
        # em / f1 extract the last <answer> themselves; a reward that extracts none (a plugin) leaves it to
        # the trajectory's own `answer` (the same last <answer> of the same text)
        traj = r.get("trajectories") or []
        return [a if a is not None or i >= len(traj) else traj[i].get("answer") for i, a in enumerate(r["extracted"])]

    def stats(pairs: list[tuple[Example, dict]]) -> dict[str, Any]:
        em = [em_score(a, ex.answers) for ex, r in pairs for a in answers(r)]
        f1 = [f1_score(a, ex.answers) for ex, r in pairs for a in answers(r)]
        traj = [t for _, r in pairs for t in r.get("trajectories", [])]
        turns = sum(t["turns"] for t in traj)
        out: dict[str, Any] = {"num_items": len(pairs), "exact_match": sum(em) / max(len(em), 1), "f1": sum(f1) / max(len(f1), 1)}
        if traj:
            out.update({
                "searches_per_question": sum(t["searches"] for t in traj) / len(traj),
                "invalid_action_rate": sum(t["invalid"] for t in traj) / max(turns, 1),
                "turns": turns / len(traj),
                "answered": sum(t["outcome"] == "answer" for t in traj) / len(traj),
            })
        return out

    everything = [p for g in groups.values() for p in g]
    return {**stats(everything), "sources": {name: stats(g) for name, g in sorted(groups.items())} if len(groups) > 1 else {}}


def search_markdown(s: dict[str, Any]) -> str:
    """The search table: one row overall, one per data source."""
    cols = ("exact_match", "f1", "searches_per_question", "invalid_action_rate", "turns")
    lines = ["| source | items | EM | F1 | searches/q | invalid | turns |", "|---|---|---|---|---|---|---|"]

    def row(name: str, x: dict[str, Any]) -> str:
        cells = [f"{100 * x[c]:.1f}" if c in ("exact_match", "f1", "invalid_action_rate") else f"{x[c]:.2f}"
                 for c in cols if c in x]
        return f"| {name} | {x['num_items']} | " + " | ".join(cells + ["-"] * (len(cols) - len(cells))) + " |"

    lines.append(row("all", s))
    lines += [row(name, x) for name, x in s.get("sources", {}).items()]
    return "\n".join(lines) + "\n\nEM, F1 and invalid (share of turns with neither a search nor an answer) in %.\n"
