"""Issue 32, a new user's first hour (third pass): what the progress line, the eval summary, the plots, `ablate`
and the README tell a newcomer."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


# ---------------------------------------------------------------- the progress line of `emapg train`
def test_progress_line_shows_the_last_held_out_accuracy():
    from emapg_cli.train.progress import step_info

    step = {"reward/mean": 0.412, "kl/value": 0.021, "throughput/tokens_per_s": 1400.0}
    assert step_info(step, held_out=(10, 0.452)) == "reward 0.412  eval 45.2%@10  kl 2.1e-02"
    assert step_info(step) == "reward 0.412  kl 2.1e-02"  # no evaluation set


def test_distillation_progress_shows_the_kl_and_the_teacher_gap_not_a_zero_reward():
    from emapg_cli.train.progress import step_info

    step = {"reward/mean": 0.0, "distill/kl": 0.0312, "kl/value": 0.0312, "throughput/tokens_per_s": 900.0}
    # teacher 82.8%, student 45.2% at step 100: 82.8 - 45.2 = 37.6 points to go
    assert step_info(step, "distill", (100, 0.452), teacher=0.828) == "distill kl 3.1e-02  eval 45.2%@100  teacher gap 37.6"
    step["reward/mean"] = 0.25  # rl+distill has a verifier: its reward is shown too
    assert step_info(step, "rl+distill", (100, 0.452), 0.828) == "reward 0.250  distill kl 3.1e-02  eval 45.2%@100  teacher gap 37.6"


def test_the_bar_carries_the_newest_evaluation(monkeypatch):
    from emapg_cli.train.progress import TrainProgress

    shown = []
    bar = TrainProgress(4, 0, show=False, held_out=0.30)
    monkeypatch.setattr(bar.bar, "update", lambda task, **kw: shown.append(kw["info"]))
    step = {"reward/mean": 0.5, "kl/value": 0.01, "throughput/tokens_per_s": 1.0}
    bar.advance(1, step, 1.0)
    bar.advance(2, {**step, "eval/accuracy": 0.40}, 1.0)
    bar.advance(3, step, 1.0)
    assert [s.split("  ")[1] for s in shown] == ["eval 30.0%@0", "eval 40.0%@2", "eval 40.0%@2"]


def test_a_distillation_runs_closing_table_names_the_teacher_not_a_zero_reward():
    from emapg_cli.train.progress import summary_rows

    summary = {"eval_accuracy_initial": 0.288, "eval_accuracy_final": 0.85, "teacher_accuracy": 0.828, "steps": 300,
               "wall_time_s": 120.0, "steps_skipped": 0, "reward_mean_last": 0.0}
    rows = dict(summary_rows(summary, "runs/toy-distill-1", objective="distill"))
    # 82.8 - 85.0 = -2.2: the student ends above its teacher
    assert rows["teacher accuracy"] == "82.8% (gap left -2.2 points)" and "last train reward" not in rows


# ---------------------------------------------------------------- the eval summary on a terminal
SUMMARY = {
    "bench": "toy", "model": "runs/toy-20260101-120000/final/policy", "num_items": 500, "n": 32, "avg@n": 0.677,
    "pass@1": 0.677, "pass@2": 0.721, "pass@4": 0.75, "pass@8": 0.772, "pass@16": 0.78, "pass@32": 0.791,
    "maj@n": 0.786, "maj@n_strict": 0.78, "strict": 0.6,
    "subsets": {"Algebra": {"num_items": 120, "pass@1": 0.612, "pass@2": 0.7, "pass@4": 0.71, "pass@8": 0.72, "pass@16": 0.73,
                            "pass@32": 0.74, "maj@n": 0.7, "maj@n_strict": 0.69, "strict": 0.5}},
    "env": {"name": "calc", "episodes": 500, "turns": 2.0, "calls": 1.0, "invalid_rate": 0.0},
}


def test_eval_summary_reads_at_80_columns():
    from emapg_cli.evaluation.report import text_summary

    text = text_summary(SUMMARY)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80 and not any(line.lstrip().startswith("|") for line in lines)
    assert lines[0] == "toy: 500 items x 32 samples, model runs/toy-20260101-120000/final/policy"
    flat = " ".join(text.split())
    for cell in ("pass@1 67.7%", "pass@32 79.1%", "maj@32 78.6%", "maj@32 strict 78.0%", "strict 60.0%",
                 "subset Algebra (120 items)", "env calc: 1.00 calls and 2.00 turns per episode"):
        assert cell in flat, cell


# ---------------------------------------------------------------- README: toy-search's extra
def test_readme_toy_search_section_says_which_extra_with_the_errors_spelling():
    from emapg_cli.retrieval.bm25 import MISSING_EXTRA

    text = README.read_text()
    start = text.index("### The toy search preset")
    section = text[start:text.index("\n## ", start)]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()  # the section's first commands
    assert block[0].startswith('pip install ".[search]"') and block[1].startswith("emapg prepare --preset toy-search")
    assert MISSING_EXTRA in " ".join(section.split()), "quote the one-line error the prepare line gives without bm25s"


# ---------------------------------------------------------------- prepare: transformers' bars stay out
@pytest.mark.parametrize("preset", ["toy", "toy-search", "toy-tools", "toy-distill"])
def test_every_toy_prepare_quiets_transformers_before_it_starts(monkeypatch, preset):
    # toy-search's prepare printed "Writing model shards" / "Loading weights" bars between emapg's own lines
    import emapg_cli.hf_quiet as hf_quiet
    from emapg_cli.cli import prepare_cmd

    calls = []
    monkeypatch.setattr(hf_quiet, "quiet_transformers", lambda: calls.append("quiet"))
    from emapg_cli.tasks import get_task

    step = get_task(preset).prepare.replace(":", ".")  # the task's declared prepare step
    monkeypatch.setattr(step, lambda home, seed, say: calls.append(f"prepare {seed}") or ("", {"rows": {}}, []))
    prepare_cmd.prepare(names=None, from_file=None, out=None, preset=preset, seed=3, decontaminate=False, remove=False,
                        ngram=13, list_=False)
    assert calls == ["quiet", "prepare 3"]


# ---------------------------------------------------------------- plots: what each toy is about
def _rows(steps: int, **extra) -> list[dict]:
    """metrics.jsonl rows: reward, KL and `extra` metrics (name -> value per step) at steps 1..steps, and an
    evaluation at steps 0 and `steps`."""
    rows = [{"step": 0, "eval/accuracy": 0.3}]
    for s in range(1, steps + 1):
        rows.append({"step": s, "reward/mean": 0.1 * s, "kl/value": 0.01, **{k: f(s) for k, f in extra.items()}})
    rows[-1]["eval/accuracy"] = 0.5
    return rows


def test_each_toy_gets_the_panel_of_what_it_is_about(tmp_path):
    from emapg_cli.plots.train import plot_runs

    search = _rows(4, **{"search/calls_per_episode": lambda s: 0.5 * s, "env/calls": lambda s: 0.5 * s})
    tools = _rows(4, **{"env/calls": lambda s: 0.2 * s})
    names = lambda runs, out: [p.name for p in plot_runs(runs, tmp_path / out)]  # noqa: E731
    # the search agent's env/calls repeats its searches: one panel, "searches"
    assert names([("s", search)], "s") == ["eval_accuracy.png", "searches.png", "reward.png", "kl.png", "training.png"]
    assert names([("t", tools)], "t") == ["eval_accuracy.png", "tool_calls.png", "reward.png", "kl.png", "training.png"]
    assert "searches.png" not in names([("plain", _rows(4))], "plain")


def test_a_distillation_run_draws_its_teacher_and_not_a_zero_reward(tmp_path, monkeypatch):
    from emapg_cli.plots.train import plot_runs, pyplot

    rows = _rows(4, **{"distill/kl": lambda s: 0.3 / s})
    rows[0]["eval/teacher_accuracy"] = 0.828
    for r in rows[1:]:
        r["reward/mean"] = 0.0  # no verifier
    drawn = {}
    plt = pyplot()
    real = plt.Figure.savefig

    def keep(fig, *a, **k):  # what each figure holds, read before it is closed
        drawn[len(drawn)] = [(line.get_label(), list(line.get_ydata())) for ax in fig.axes for line in ax.get_lines()]
        return real(fig, *a, **k)

    monkeypatch.setattr(plt.Figure, "savefig", keep)
    paths = [p.name for p in plot_runs([("d", rows)], tmp_path)]
    assert paths == ["eval_accuracy.png", "kl.png", "training.png"]  # no reward panel of zeros
    assert ("teacher 82.8%", [82.8, 82.8]) in drawn[0]  # the dashed reference line on the accuracy panel (in %, issue 40)


def test_a_one_sample_evaluation_draws_no_single_dot(tmp_path):
    from emapg_cli.plots.eval import no_curve, plot_evals
    from emapg_cli.plots.folders import plot_folders
    from emapg_cli.errors import UserError

    one = {"n": 1, "pass@1": 0.713, "maj@n": 0.713, "subsets": {}, "sources": {}}
    assert plot_evals([("m", one)], tmp_path / "a") == [] and "n = 1" in no_curve([("m", one)])
    ev = tmp_path / "ev"
    ev.mkdir()
    (ev / "summary.json").write_text(json.dumps({**one, "num_items": 300}))
    (ev / "results.jsonl").write_text("")
    with pytest.raises(UserError, match="nothing to plot: no pass@k curve: one sample per problem"):
        plot_folders([ev], tmp_path / "b")
    four = {**one, "n": 4, "pass@2": 0.8, "pass@4": 0.85}
    assert [p.name for p in plot_evals([("m", four)], tmp_path / "c")] == ["pass_at_k.png"]


def test_plot_of_one_run_writes_to_the_working_folder_not_into_the_run(tmp_path, monkeypatch):
    from emapg_cli.plots.folders import plot_folders

    run = tmp_path / "runs" / "toy-1"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(3)))
    monkeypatch.chdir(tmp_path)
    kind, out, paths = plot_folders([run])
    assert kind == "train" and out == Path("plots") and (tmp_path / "plots" / "training.png").is_file()
    assert not (run / "plots").exists()


# ---------------------------------------------------------------- the README's commands leave the clone clean
#: Where a command writes in the working folder when no option says (None: nothing there; prepare writes under
#: $EMAPG_HOME): train's runs/<name>-<time>, eval's runs/eval/<bench>-<model>, ablate's ablations/<study>-<preset>,
#: plot's ./plots.
DEFAULT_WRITES = {"train": "runs/x", "eval": "runs/eval/x", "ablate": "ablations/x", "plot": "plots/x.png"}
#: Options that name a file or folder a command writes, per command ("*": every command).
PATH_OPTIONS = {"*": ("--out", "-o"), "kl-check": ("--json", "--plot"), "bench": ("--json",)}


def readme_commands() -> list[list[str]]:
    """Each `emapg ...` command of the README's bash blocks, as words (comments dropped, `a && b` split)."""
    import shlex

    out = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for part in re.split(r"&&|;|\|", line.split(" # ")[0].split("  #")[0]):
                words = shlex.split(part.replace("$", "\\$"))
                while words and "=" in words[0]:
                    words = words[1:]  # CUDA_VISIBLE_DEVICES=7 emapg ...
                if words[:1] == ["do"]:
                    words = words[1:]
                if words[:1] == ["emapg"]:
                    out.append(words[1:])
    return out


def writes(words: list[str]) -> list[str]:
    """The paths in the working folder that `emapg *words` writes (absolute, $-prefixed and ~ paths are outside)."""
    command = words[0]
    options = PATH_OPTIONS["*"] + PATH_OPTIONS.get(command, ())
    named = [words[i + 1] for i, w in enumerate(words[:-1]) if w in options]
    if ">" in words:
        named.append(words[words.index(">") + 1])
    if not named and "--dry-run" not in words:
        named = [DEFAULT_WRITES[command]] if command in DEFAULT_WRITES else []
    return [p for p in named if not p.startswith(("/", "$", "~"))]


def test_every_readme_command_writes_only_where_git_ignores(tmp_path):
    import shutil
    import subprocess

    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and this checkout's .git (CI runs in one)")
    commands = readme_commands()
    assert len(commands) > 40 and ["plot", "runs/toy-[0-9]*/"] in commands  # the parser reads the README
    paths = sorted({p for words in commands for p in writes(words)})
    assert "plots/x.png" in paths and "runs/kl_check.json" in paths  # defaults and options are both found
    r = subprocess.run(["git", "check-ignore", "--no-index", "--verbose", "--non-matching", *paths], cwd=ROOT,
                       capture_output=True, text=True)
    # `--non-matching`: a path no pattern ignores is printed as "::\tpath"
    tracked = [line.split("\t")[1] for line in r.stdout.splitlines() if line.startswith("::")]
    assert tracked == [], f"README commands write files git would list in a clone: {tracked}"


def test_the_writes_parser_knows_the_defaults_and_the_options():
    assert writes(["plot", "runs/a/"]) == ["plots/x.png"]
    assert writes(["ablate", "--study", "paper", "--dry-run", ">", "sweep.sh"]) == ["sweep.sh"]
    assert writes(["train", "--preset", "olympiad", "--dry-run"]) == []
    assert writes(["kl-check", "--plot", "docs/kl_check.png", "--json", "out.json"]) == ["docs/kl_check.png", "out.json"]
    assert writes(["prepare", "--preset", "toy"]) == [] and writes(["retriever", "query", "i/", "q", "--json"]) == []


# ---------------------------------------------------------------- emapg ablate: order, |V|, one seed, whiskers, %
def _spec(k, seed=0, written=None):
    from emapg_cli.ablate.grid import RunSpec

    return RunSpec(f"kl.k={k}", seed, {"kl.k": k}, (f"kl.k={k}", f"train.seed={seed}"), {"kl.k": written or str(k)})


def _record(spec, final):
    from emapg_cli.ablate.aggregate import RunRecord

    return RunRecord(spec, "done", {"eval_accuracy_final": final, "eval_accuracy_initial": 0.3, "eval_accuracy_best": final},
                     {"eval/accuracy": [(0, 0.3), (3, final)]})


def test_configurations_are_ordered_by_number_and_vocab_reads_as_such():
    from emapg_cli.ablate.aggregate import label_of, natural_order, summarize

    specs = [_spec(259, written='"|V|"'), _spec(8), _spec(1)]  # as a plan might list them
    assert natural_order(specs, ["kl.k"]) == {"kl.k=1": 0, "kl.k=8": 1, "kl.k=259": 2}  # not 1, 259, 8
    assert label_of({"kl.k": 259}, ["kl.k"], {"kl.k": '"|V|"'}) == "kl.k=|V| (259)"
    # equal accuracies rank in that order too
    ranked = summarize([_record(specs[0], 0.5), _record(specs[1], 0.5), _record(specs[2], 0.5)], ["kl.k"])
    assert [c.label for c in ranked] == ["kl.k=1", "kl.k=8", "kl.k=|V| (259)"]


def test_a_one_seed_ranking_carries_a_caveat_and_accuracies_are_percent(tmp_path):
    from emapg_cli.ablate.aggregate import format_ci, format_mean_std, one_seed_caveat, summarize
    from emapg_cli.stats import mean_ci

    one = summarize([_record(_spec(1), 0.5), _record(_spec(8), 0.6)], ["kl.k"])
    assert "one seed per configuration" in one_seed_caveat(one)
    two = summarize([_record(_spec(1, 0), 0.5), _record(_spec(1, 1), 0.7)], ["kl.k"])
    assert one_seed_caveat(two) is None
    iv = mean_ci([0.5, 0.7])  # mean 0.6, std 0.141421, t(0.975, 1) = 12.7062: half 12.7062 * 0.141421 / sqrt 2 = 1.27062
    assert (format_mean_std(iv, percent=True), format_ci(iv, percent=True)) == ("60.0 ± 14.1", "[-67.1, 187.1]")


def test_final_accuracy_bars_draw_the_whiskers_they_promise(tmp_path, monkeypatch):
    from matplotlib.container import ErrorbarContainer

    from emapg_cli.ablate.aggregate import summarize
    from emapg_cli.ablate.plots import plot_all
    import matplotlib.pyplot as plt

    seen = []
    real = plt.Figure.savefig
    monkeypatch.setattr(plt.Figure, "savefig", lambda fig, path, **k: (seen.append((Path(path).name, fig.axes[0])),
                                                                      real(fig, path, **k))[1])
    for name, finals in (("two", [0.5, 0.7]), ("one", [0.5])):
        records = [_record(_spec(8, seed), f) for seed, f in enumerate(finals)] + [_record(_spec(1), 0.4)]
        (tmp_path / name).mkdir()
        plot_all(tmp_path / name, summarize(records, ["kl.k"]), records, name)
    bars = {title: ax for (file, ax), title in zip([s for s in seen if s[0] == "final_accuracy.png"], ("two", "one"))}
    two, one = bars["two"], bars["one"]
    assert any(isinstance(c, ErrorbarContainer) for c in two.containers) and "whiskers: 95% CI" in two.get_title()
    assert not any(isinstance(c, ErrorbarContainer) for c in one.containers) and "no CI to draw" in one.get_title()
    assert [t.get_text() for t in two.get_xticklabels()] == ["kl.k=1", "kl.k=8"] and "%" in two.get_ylabel()


def test_ablate_jobs_default_to_the_free_cores(monkeypatch):
    import torch

    from emapg_cli.ablate.runner import auto_jobs
    from emapg_cli.train import threads

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(threads, "available_cores", lambda: {0, 1})
    busy = {"now": 0.1}
    monkeypatch.setattr(threads, "measure_busy", lambda cores: (busy["now"], "idle cores"))
    assert auto_jobs(12, 1)[0] == 2  # an idle 2-core machine: two runs at once (was 1)
    assert auto_jobs(1, 1)[0] == 1  # one run left
    busy["now"] = 1.0
    assert auto_jobs(12, 1)[0] == 1  # another job holds a core
    assert auto_jobs(12, 8) == (1, "one at a time: each run takes 8 processes")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert auto_jobs(12, 1)[0] == 1


# ---------------------------------------------------------------- README and CLI say the same
def test_readme_error_examples_are_what_the_cli_prints():
    # the README's ```text blocks of `$ emapg ...` lines and the one line each prints (the allowed kl.* keys among
    # them: the list comes from the config models, so a new key changes the CLI's line and this test names it)
    from conftest import run_cli

    examples = []
    for block in re.findall(r"```text\n(.*?)```", README.read_text(), re.S):
        lines = block.strip().splitlines()
        examples += [(a[2:], b) for a, b in zip(lines, lines[1:]) if a.startswith("$ emapg ") and b.startswith("error:")]
    assert len(examples) >= 2 and any("allowed in kl:" in out for _, out in examples)
    for command, expected in examples:
        r = run_cli(*command.split()[1:], env={"COLUMNS": "400"})
        assert (r.returncode, r.stderr.strip()) == (2, expected), command


def test_readme_search_qa_memory_advice_is_the_dry_runs():
    from emapg_cli.config import load_config
    from emapg_cli.train.plan import load_model_config, make_plan

    cfg = load_config("search-qa")
    plan = make_plan(cfg, load_model_config(cfg.model.path), processes=1)
    note = next(n for n in plan.notes if "rollout peak exceeds" in n)
    # state 46.0 GiB on an 80 GiB device leaves 34.0 GiB = 0.425 of it: 0.4 in steps of 0.05, 46.0 + 32.0 = 78.0 GiB
    assert "rollout.gpu_memory_utilization <= 0.4 fits (rollout peak 78.0 GiB; now 0.5)" in note
    text = " ".join(README.read_text().split())
    assert "set `rollout.gpu_memory_utilization=0.4` (78.0 GiB" in text and "`rollout.gpu_memory_utilization <= 0.4 fits`" in text
