"""Agents: multi-turn rollouts over the `Engine` interface. `search.SearchAgent` is the Search-R1 protocol."""

from emapg_cli.agents.search import Episode, SearchAgent, search_metrics

__all__ = ["Episode", "SearchAgent", "search_metrics"]
