"""`Task`, a built-in task's declaration: plain data that every floor may read (docs/architecture.md)."""

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Task:
    """`emapg prepare --preset NAME` writes the task under $EMAPG_HOME/NAME; presets/NAME.yaml trains on it."""

    name: str
    prepare: str  # its prepare step, `module:function(home, seed, say) -> (title, manifest, table rows)`, run by the CLI
    reward: str  # the reward its preset grades with
    bench: Optional[str] = None  # its evaluation set in its folder: `emapg eval --bench NAME`
    env: Optional[str] = None  # the environment its episodes run in (None: one turn); `--bench NAME` then reads the preset
    reward_alias: bool = False  # its name is also a reward name, for `reward`
