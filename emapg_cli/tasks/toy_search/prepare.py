"""`emapg prepare --preset toy-search`: the toy search task, its corpus and BM25 index, a warm-started model.

Writes, under `<home>/toy-search/`:
  * `train.jsonl`, `test.jsonl` — canonical rows (`emapg_cli.tasks.toy_search.task`);
  * `corpus.jsonl` and `index/` — one passage per fact, indexed with the `bm25` retriever;
  * `prompt.txt` — the one-line user-message template (`search.prompt_template` of the preset);
  * `model/` — a tiny Llama and its byte tokenizer after the supervised warm start below;
  * `manifest.json` — seed, sizes, the warm-start settings and curve, greedy test exact match
    with search and with search disabled, measured as `emapg train --preset toy-search` does.

The warm start teaches the protocol on gold episodes of training-entity questions: each episode is
the prompt, the gold searches, the observations the real retriever returns (masked out of the
loss, as in RL) and the answer. It stops at the first check where greedy dev exact match (the full
agent loop, real retriever) reaches `target_accuracy`: the model then formats searches and answers
but copies the right answer only part of the time, which RL improves.
"""

from __future__ import annotations

import contextlib
import random
import time
from pathlib import Path
from typing import Any, Callable, Optional

from emapg_cli.agents import protocol
from emapg_cli.agents.environments import make_environment
from emapg_cli.config import load_config
from emapg_cli.data.schema import Example, write_jsonl
from emapg_cli.models.prompts import render_prompt
from emapg_cli.models.tiny import CHAT_TEMPLATE, build_byte_tokenizer
from emapg_cli.outputs import claim_prepare
from emapg_cli.rewards import get_reward
from emapg_cli.tasks.toy.prepare import greedy_accuracy, save_warm_start, sft_threads, tiny_llama
from emapg_cli.tasks.toy.sft import IGNORE, SFTConfig, fit
from emapg_cli.tasks.toy_search import TASK
from emapg_cli.tasks.toy_search.task import SOURCE, TEMPLATE, make_questions, make_world, sample_question

SIZES = {"train": 600, "dev": 100, "test": 150}  # entities per split
N_TRAIN, N_DEV, N_TEST = 2000, 100, 300  # questions per split
SFT = SFTConfig(hidden=64, layers=3, heads=4, kv_heads=2, max_steps=3000, check_every=10,
                target_accuracy=0.3, batch_size=32, lr=3e-3, warmup=50)
CHECK_SPARSE = 5  # dev checks before the first correct answer: every 5th (every 50 steps)
#: Byte-level BPE with merges learnt from the task's texts without the names (`tokenizer_texts`): tags and
#: template words become single tokens, so episodes are ~90-140 tokens.
VOCAB = 512


class EpisodeEncoder:
    """Token ids and labels of gold episodes, built exactly as the agent loop builds a trajectory."""

    def __init__(self, tokenizer, retriever, cfg):
        self.tok, self.retriever, self.cfg = tokenizer, retriever, cfg
        self.template = protocol.load_template(cfg.search.prompt_template)
        self._hits: dict[str, list] = {}

    def _ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def observation(self, query: str) -> list[int]:
        if query not in self._hits:
            self._hits[query] = self.retriever.search([query], self.cfg.search.topk)[0]
        return self._ids(protocol.information(self._hits[query]))[: self.cfg.search.max_obs_tokens]

    def prompt(self, question: str) -> list[int]:
        return render_prompt(self.tok, protocol.format_question(question, self.template))

    def __call__(self, question: str, queries: list[str], answer: str) -> tuple[list[int], list[int]]:
        """Prompt + (search turn, observation) per query + answer turn; labels only on the policy's turns."""
        ids = self.prompt(question)
        labels = [IGNORE] * len(ids)
        for q in queries:
            turn = self._ids(f"<search> {q} </search>")
            obs = self.observation(q)
            ids, labels = ids + turn + obs, labels + turn + [IGNORE] * len(obs)
        turn = self._ids(f"<answer> {answer} </answer>")
        return ids + turn, labels + turn


def tokenizer_texts(world, examples: list[Example], retriever, cfg) -> list[str]:
    """Texts the toy's byte-level BPE learns its merges from: the corpus, the chat template's words and every
    gold episode (prompt, searches, observations, answer), with the invented names removed.

    Tags and template words become single tokens; names stay bytes. A name merged into one token would be
    a token the warm start never trains when only held-out entities carry it, and a model cannot copy a
    token whose embedding is still random; spelled in bytes, every name is made of trained tokens.
    """
    import re

    names = {n for e, f in world.facts.items() for n in (e, *f.values())}
    unnamed = lambda text: re.sub(r"[A-Za-z]+", lambda m: "" if m.group(0) in names else m.group(0), text)  # noqa: E731

    texts = [d["contents"] for d in world.corpus()] + [CHAT_TEMPLATE, "<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n"]
    queries = sorted({q for e in examples for q in e.meta["queries"]})
    observations = dict(zip(queries, (protocol.information(h) for h in retriever.search(queries, cfg.search.topk))))
    for e in examples:
        turns = "".join(f"<search> {q} </search>{observations[q]}" for q in e.meta["queries"])
        texts.append(f"{e.question}\n{turns}<answer> {e.answers[0]} </answer>")
    return [unnamed(t) for t in texts]


def agent_accuracy(model, tokenizer, examples: list[Example], cfg, retriever, max_turns: Optional[int] = None) -> float:
    """Greedy exact match of the agent loop on `examples` (hf engine, `cfg.search`, the `em` reward);
    `max_turns=0` disables search (only the final no-search turn runs)."""
    env = make_environment(TASK.env, tokenizer, search=cfg.search, retriever=retriever, max_turns=max_turns)
    message = env.user_message()
    prompts = [render_prompt(tokenizer, message(e.question)) for e in examples]
    with contextlib.closing(get_reward(cfg.rollout.reward)) as reward:
        return greedy_accuracy(model, tokenizer, examples, prompts, reward, cfg.eval.max_new_tokens, env)


def _bar(enabled: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

    from emapg_cli.progress import Progress

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("loss {task.fields[loss]:.3f} dev EM {task.fields[dev]}"), disable=not enabled)


def prepare_toy_search(home: Path, seed: int = 0, progress: bool = False, sft: SFTConfig = SFT) -> dict[str, Any]:
    """Generate the task, index its corpus and warm-start its model under `home/toy-search`; returns the manifest."""
    from emapg_cli.retrieval.bm25 import BM25Retriever, build_index, remove_index

    start = time.perf_counter()
    out = Path(home) / TASK.name
    world = make_world(seed, SIZES)
    train = make_questions(world, seed, "train", N_TRAIN)
    dev = make_questions(world, seed, "dev", N_DEV)
    test = make_questions(world, seed, "test", N_TEST)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "train.jsonl", (e.model_dump() for e in train))
    write_jsonl(out / "test.jsonl", (e.model_dump() for e in test))
    write_jsonl(out / "corpus.jsonl", world.corpus())
    (out / "prompt.txt").write_text(TEMPLATE, encoding="utf-8")
    remove_index(out / "index")  # only an index emapg wrote (a stale one of an earlier prepare)
    build_index(out / "corpus.jsonl", out / "index")
    retriever = BM25Retriever.load(str(out / "index"))

    cfg = load_config(TASK.name)  # its paths point under $EMAPG_HOME; set ours explicitly
    cfg = cfg.model_copy(update={"search": cfg.search.model_copy(update={"prompt_template": str(out / "prompt.txt")})})
    tokenizer = build_byte_tokenizer(corpus=tokenizer_texts(world, train + dev + test, retriever, cfg), vocab_size=VOCAB)
    model = tiny_llama(tokenizer, sft, seed)

    encode = EpisodeEncoder(tokenizer, retriever, cfg)
    rng = random.Random(f"{seed}-sft")

    def next_batch():
        qs = [sample_question(rng, world, "train") for _ in range(sft.batch_size)]
        return [encode(q.text, q.queries(world), q.answer(world)) for q in qs]

    dev_curve: list[tuple[int, float]] = []  # (SFT step, greedy dev exact match) of each evaluated check
    with sft_threads(), contextlib.closing(retriever), _bar(progress) as bar:
        task = bar.add_task("warm start (SFT)", total=sft.max_steps, loss=float("nan"), dev="-")

        checks = iter(range(1, sft.max_steps + 1))
        step = [0]

        def reached_target() -> bool:
            # Copying is learnt abruptly (0% -> 60% dev EM within ~50 steps after a ~300-step plateau):
            # check every CHECK_SPARSE-th time until the model has answered anything once, then at every check.
            if next(checks) % CHECK_SPARSE and not any(acc for _, acc in dev_curve):
                return False
            dev_curve.append((step[0], agent_accuracy(model, tokenizer, dev, cfg, retriever)))
            bar.update(task, dev=f"{dev_curve[-1][1]:.1%}")
            return dev_curve[-1][1] >= sft.target_accuracy

        def advance(done: int, loss: float) -> None:
            step[0] = done
            bar.update(task, completed=done, loss=loss)

        sft_start = time.perf_counter()
        losses = fit(model, sft, seed, next_batch, tokenizer.pad_token_id, reached_target, progress=advance)
        sft_seconds = time.perf_counter() - sft_start
        bar.update(task, total=len(losses), description="greedy test exact match ...")
        accuracy = agent_accuracy(model, tokenizer, test, cfg, retriever)
        no_search = agent_accuracy(model, tokenizer, test, cfg, retriever, max_turns=0)

    return save_warm_start(out, model, tokenizer, {
        "name": TASK.name,
        "source": SOURCE,
        "seed": seed,
        "rows": {"train": len(train), "test": len(test), "corpus": len(world.corpus())},
        "entities": SIZES,
    }, sft, losses, {
        "sft_dev_accuracy": [list(x) for x in dev_curve],
        "sft_wall_s": round(sft_seconds, 1),
        "sft_test_accuracy": accuracy,
        "sft_test_accuracy_no_search": no_search,
        "wall_s": round(time.perf_counter() - start, 1),
    })


def run(home: Path, seed: int, say: Callable[[str], None]) -> tuple[str, dict[str, Any], list[tuple[str, str]]]:
    """The declared prepare step, `emapg prepare --preset toy-search` (holding the folder): (table title, manifest, rows)."""
    with claim_prepare(Path(home) / TASK.name, f"--preset {TASK.name}"):
        m = prepare_toy_search(home, seed, progress=True)
    return "prepared the toy search task", m, [
        ("model", f"{m['model']['arch']}, {m['model']['parameters']:,} parameters ({TASK.name}/model)"),
        ("warm start", f"{m['sft_steps']} steps in {m['sft_wall_s']:.0f} s, greedy test exact match "
                       f"{m['sft_test_accuracy']:.1%} (search disabled: {m['sft_test_accuracy_no_search']:.1%})")]
