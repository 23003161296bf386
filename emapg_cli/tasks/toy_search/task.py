"""The toy search task: questions about invented entities whose answers exist only in a corpus.

A world is a seeded set of entities with made-up names (`Doka`, `Mipe`, ...). Each entity has
four facts: `city`, `pet` and `food` (values from pools of invented words) and `boss` (another
entity of the same split). Each fact is one corpus passage, titled with the entity:

    {"id": "Doka-city", "contents": "Doka\\nDoka city Rulo"}

so a search for `Doka city` returns it first (both words match) and the entity's other facts as
distractors. Questions need one search ("city of Doka?") or two ("city of boss of Doka?": search `Doka boss`, read `boss Mipe`, search `Mipe city`). Train, dev and
test questions are about disjoint entity sets, so a model cannot have memorised a test answer: it
must search and copy the answer from the passage. Without search, a guess from the value pool
is right about 1/POOL of the time.

The protocol is Search-R1's (`<search> q </search>`, `<information>...</information>`,
`<answer> a </answer>`), with a one-line prompt template instead of Search-R1's paragraph so a
byte-level model's sequences stay short. Everything is a pure function of the seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from emapg_cli.data.schema import Example

SOURCE = "toy-search"
VALUE_ATTRS = ("city", "pet", "food")
LINK_ATTR = "boss"
POOL = 40  # values per value attribute: the no-search guessing rate is about 1/POOL
#: The toy's user-message template (`search.prompt_template`); `{question}` is Search-R1's formatting of the question.
TEMPLATE = "{question}"

_CONS, _VOWELS = "bdfgklmnprstvz", "aeiou"


def _names(rng: random.Random, n: int, taken: set[str]) -> list[str]:
    """`n` new capitalised consonant-vowel-consonant-vowel names (`Doka`), none in `taken`."""
    out = []
    while len(out) < n:
        name = "".join(rng.choice(s) for s in (_CONS, _VOWELS, _CONS, _VOWELS)).capitalize()
        if name not in taken:
            taken.add(name)
            out.append(name)
    return out


@dataclass(frozen=True)
class World:
    """Entities by split and their facts: facts[entity][attr] = value (a word, or an entity for `boss`)."""

    splits: dict[str, list[str]]
    facts: dict[str, dict[str, str]]

    def corpus(self) -> list[dict[str, str]]:
        """One FlashRAG row per fact: id `Entity-attr`, contents `Entity\\nEntity attr value`.

        The text repeats the title, as wiki-18's passages do; it also makes `Doka boss` rank Doka's own boss
        passage above the passages of entities whose boss is Doka (those match both words once)."""
        return [{"id": f"{e}-{a}", "contents": f"{e}\n{e} {a} {v}"} for e, f in self.facts.items() for a, v in f.items()]


def make_world(seed: int, sizes: dict[str, int]) -> World:
    """A world with `sizes[split]` entities per split; bosses are drawn within the entity's split."""
    rng = random.Random(seed)
    taken: set[str] = set()
    pools = {a: _names(rng, POOL, taken) for a in VALUE_ATTRS}
    splits = {split: _names(rng, n, taken) for split, n in sizes.items()}
    facts: dict[str, dict[str, str]] = {}
    for entities in splits.values():
        for e in entities:
            facts[e] = {a: rng.choice(pools[a]) for a in VALUE_ATTRS}
            facts[e][LINK_ATTR] = rng.choice([o for o in entities if o != e])
    return World(splits, facts)


@dataclass(frozen=True)
class Question:
    """`attr` of `entity` (one hop) or of `entity`'s boss (two hops)."""

    entity: str
    attr: str
    hops: int

    @property
    def text(self) -> str:
        if self.hops == 1:
            return f"{self.attr} of {self.entity}?"
        return f"{self.attr} of {LINK_ATTR} of {self.entity}?"

    def answer(self, world: World) -> str:
        e = self.entity if self.hops == 1 else world.facts[self.entity][LINK_ATTR]
        return world.facts[e][self.attr]

    def queries(self, world: World) -> list[str]:
        """The searches of a correct episode, in order."""
        if self.hops == 1:
            return [f"{self.entity} {self.attr}"]
        return [f"{self.entity} {LINK_ATTR}", f"{world.facts[self.entity][LINK_ATTR]} {self.attr}"]


def sample_question(rng: random.Random, world: World, split: str) -> Question:
    """Uniform entity of `split`, uniform value attribute, one or two hops with equal odds."""
    return Question(rng.choice(world.splits[split]), rng.choice(VALUE_ATTRS), rng.choice((1, 2)))


def to_example(q: Question, world: World, split: str, index: int) -> Example:
    """A question as a canonical row (meta: hops, entity, attribute, the gold queries)."""
    return Example(
        id=f"toy-search-{split}-{index:05d}",
        question=q.text,
        answers=[q.answer(world)],
        source=SOURCE,
        meta={"hops": q.hops, "entity": q.entity, "attr": q.attr, "queries": q.queries(world), "subset": f"{q.hops}-hop"},
    )


def make_questions(world: World, seed: int, split: str, n: int) -> list[Example]:
    """`n` distinct questions about `split`'s entities (fewer if the split has fewer distinct ones)."""
    rng = random.Random(f"{seed}-{split}")
    limit = len(world.splits[split]) * len(VALUE_ATTRS) * 2
    seen: set[str] = set()
    out: list[Example] = []
    while len(out) < min(n, limit):
        q = sample_question(rng, world, split)
        if q.text not in seen:
            seen.add(q.text)
            out.append(to_example(q, world, split, len(out)))
    return out
