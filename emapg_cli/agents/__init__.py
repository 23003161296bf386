"""Environments and agents: multi-turn rollouts over the `Engine` interface (docs/environments.md).

`environments.make_environment` is the one factory (single-turn, the Search-R1 agent of `search`, and user
classes run by `runner.EnvRunner`); `episode.Episode` is the token-exact trajectory they all return.
"""

from emapg_cli.agents.episode import Episode
from emapg_cli.agents.search import SearchAgent, search_metrics

__all__ = ["Episode", "SearchAgent", "search_metrics"]
