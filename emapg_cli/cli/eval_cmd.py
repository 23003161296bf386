"""`emapg eval`: sample and grade a model on a benchmark (or grade given responses); resumable."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Optional

import typer

from emapg_cli.cli.common import ConfigOpt, PresetOpt, SetOpt, check_seconds_option, console
from emapg_cli.errors import UserError

#: With --preset/--config/--set, each eval option given on the command line overrides this config key (so the
#: config's own checks, the ones `train` runs, see the values the evaluation will use).
FLAG_KEYS = {
    "limit": ("data.eval_limit",), "n": ("eval.n",), "temperature": ("eval.temperature",),
    "top_p": ("eval.top_p",), "max_tokens": ("eval.max_new_tokens",), "dtype": ("model.dtype",),
    "reward": ("rollout.reward",), "env": ("rollout.env",), "agent": ("rollout.agent",), "truncated": ("reward.truncated",),
    "think": ("grading.think",), "topk": ("search.topk",), "max_obs_tokens": ("search.max_obs_tokens",),
    "prompt_template": ("search.prompt_template",),
    "max_context_tokens": ("search.max_context_tokens", "rollout.max_context_tokens"),
}


def _given(ctx: typer.Context) -> set[str]:
    """The options the user typed (not left at their defaults)."""
    return {name for name in ctx.params  # (by the source's name: typer may bring its own click)
            if getattr(ctx.get_parameter_source(name), "name", "DEFAULT") not in ("DEFAULT", "DEFAULT_MAP")}


def _yaml_value(value) -> str:
    """`value` as the YAML text of a `--set KEY=VALUE` item that reads back as the same value: a string (a path with
    ` #`, a leading `*`, `!`, ...) is a JSON-quoted string, which YAML reads as written."""
    import json

    return json.dumps(value) if isinstance(value, list) else json.dumps(str(value)) if isinstance(value, (str, Path)) else str(value).lower() if isinstance(value, bool) else str(value)


def _flag_overrides(params: dict, given: set[str]) -> list[str]:
    """The typed eval options as `--set KEY=VALUE` overrides of the config (FLAG_KEYS; --retriever and --max-turns
    set the search section; --backend rollout.engine); string values quoted (`_yaml_value`)."""
    from emapg_cli.evaluation.search import parse_retriever

    out: list[str] = []
    for name in sorted(given):
        value = params[name]
        if value is None:
            continue
        if isinstance(value, Path):
            value = value.absolute()
        for key in FLAG_KEYS.get(name, ()):
            out.append(f"{key}={_yaml_value(value)}")
        if name == "retriever":
            out += ["search.enabled=true", *(f"search.{k}={_yaml_value(v)}" for k, v in parse_retriever(value).items())]
        if name == "max_turns" and (params.get("retriever") is not None or params.get("env") in (None, "search")):
            out.append(f"search.max_turns={value}")
        if name == "backend" and value != "auto":
            out.append(f"rollout.engine={_yaml_value(value)}")
    return out


#: The config keys each implied eval option comes from (beyond FLAG_KEYS): with --set alone (no --preset/--config)
#: an option takes the config's value only when a --set item touched one of its keys, else eval's own default.
IMPLIED_KEYS = {**FLAG_KEYS, "bench": ("data.eval",), "backend": ("rollout.engine",), "max_turns": ("search.max_turns",),
                "retriever": ("search.enabled", "search.retriever", "search.index", "search.url")}


def _set_keys(overrides: list[str]) -> set[str]:
    """The dotted config keys the --set items name."""
    from emapg_cli.config.loading import parse_override

    keys = set()
    for item in overrides:
        try:
            keys.add(".".join(parse_override(item)[0]))
        except UserError:
            continue  # the config's own parsing reports it
    return keys


def _origin(name: str, given: set[str], set_keys: set[str], files: str) -> str:
    """Where eval option `name` comes from: the command line, --set, the --preset/--config files, or eval's defaults."""
    if name in given:
        return "typed"
    if any(k == t or k.startswith(t + ".") for k in IMPLIED_KEYS.get(name, ()) for t in set_keys):
        return "--set"
    return files or "eval's default"


def _implied(cfg) -> dict:
    """The eval options a resolved config implies (see `_from_config`)."""
    from emapg_cli.paths import expand
    from emapg_cli.train.evaluate import eval_max_new_tokens

    search, user_env = cfg.search.enabled, cfg.rollout.env not in ("single", "search") or cfg.rollout.agent is not None
    retriever = None
    if search:
        retriever = (f"{cfg.search.retriever}:{expand(cfg.search.index) if cfg.search.index else ''}"
                     if cfg.search.retriever in ("bm25", "dense") else
                     ",".join(cfg.search.url) if isinstance(cfg.search.url, list) else cfg.search.url)
    return {
        "bench": str(expand(cfg.data.eval)) if isinstance(cfg.data.eval, str) else None, "limit": cfg.data.eval_limit,
        "backend": cfg.rollout.engine, "n": cfg.eval.n, "temperature": cfg.eval.temperature, "top_p": cfg.eval.top_p,
        "max_tokens": eval_max_new_tokens(cfg, cfg.train.steps), "dtype": cfg.model.dtype, "reward": cfg.rollout.reward,
        "env": cfg.rollout.env, "agent": cfg.rollout.agent, "truncated": cfg.reward.truncated, "think": cfg.grading.think, "retriever": retriever,
        "max_turns": cfg.search.max_turns if search else None, "topk": cfg.search.topk,
        "max_obs_tokens": cfg.search.max_obs_tokens,
        "max_context_tokens": cfg.rollout.max_context_tokens if user_env else cfg.search.max_context_tokens,
        "prompt_template": expand(cfg.search.prompt_template) if search and cfg.search.prompt_template else None,
    }


def _from_config(ctx: typer.Context, preset: Optional[str], config: Optional[str], overrides: Optional[list[str]]):
    """(config, the eval options it implies, where each came from): --preset/--config/--set as `train` resolves them,
    then the typed eval options on top (they win), validated by the same checks as training. With --preset/--config
    the options not typed take the run's environment, prompt, retriever, reward and budgets: data.eval,
    rollout.engine/env/reward, the `eval` section's sampling, eval.max_new_tokens per turn (capped as the final
    evaluation of the run is), search.*, reward.truncated, grading.think, data.eval_limit, model.dtype. With --set
    alone, an option takes the config's value only when a --set item touched its key; the others keep eval's own
    defaults (Config's defaults, e.g. eval.n = 1, are not eval's)."""
    from emapg_cli.config import load_config

    params, given = dict(ctx.params), _given(ctx)
    cfg = load_config(preset, config, [*(overrides or []), *_flag_overrides(params, given)])
    # (a reward or environment plugin the files name runs only with --trust-code: eval_ checks it, as train does)
    if not isinstance(cfg.data.eval, str) and "bench" not in given and (preset or config):
        raise UserError("give --bench: the config's data.eval " + ("is not set" if cfg.data.eval is None else "lists several sets"))
    implied = _implied(cfg)
    if implied["max_turns"] is None:
        implied["max_turns"] = params["max_turns"]
    if params.get("responses") is not None:  # given responses are only graded: the config's environment does not run
        implied.update(retriever=None, env=None, agent=None, prompt_template=None)
    files = " and ".join([*([f"--preset {preset}"] if preset else []), *([f"--config {config}"] if config else [])])
    set_keys = _set_keys(overrides or [])
    origin = {k: _origin(k, given, set_keys, files) for k in implied}
    return cfg, {k: (implied[k] if origin[k] not in ("typed", "eval's default") else params[k]) for k in implied}, origin


def _check_env_options(o: dict) -> None:
    """Cross-check --env/--retriever/--responses/--prompt-template (one line each), read the template, and fill the
    defaults that depend on them (n, temperature, max tokens, turns: greedy and short with an environment)."""
    from emapg_cli.agents.environments import check_env

    env, retriever, responses = o["env"], o["retriever"], o["responses"]
    try:  # the check training's rollout.env gets; a file path is made absolute
        o["env"] = env = check_env(env) if env is not None else None
    except UserError as e:
        raise UserError(f"--env: {str(e).removeprefix('rollout.env: ').removeprefix('rollout.env ')}") from None
    if o["agent"] is not None:
        _check_agent_option(o)
    if env == "search" and retriever is None:
        raise UserError("--env search needs --retriever (bm25:DIR, dense:DIR or http://HOST:PORT)")
    if retriever is not None and env not in (None, "search"):
        raise UserError(f"--retriever runs the search agent; it contradicts --env {env}")
    if env is not None and env != "single" and responses is not None:
        raise UserError("--env runs an environment on --model; given --responses are only graded")
    user_env, searching = env not in (None, "single", "search") or o["agent"] is not None, retriever is not None
    if searching and responses is not None:
        raise UserError("--retriever runs the search agent on --model; given --responses are only graded")
    if not searching and o["prompt_template"] is not None:
        raise UserError("--prompt-template applies only with --retriever")
    if o["prompt_template"] is not None:  # read now (one line on a bad file), not after the model is loaded
        from emapg_cli.agents.protocol import load_template

        try:
            load_template(str(o["prompt_template"]))
        except UserError as e:
            raise UserError(str(e).replace("search.prompt_template: ", "--prompt-template ", 1)) from None
    defaults = {"n": 1 if searching else 32, "temperature": 0.0 if searching else 0.8,
                "max_tokens": 500 if searching or user_env else 28000, "max_turns": None if user_env else 4}
    o.update({k: v for k, v in defaults.items() if o[k] is None})


def _check_agent_option(o: dict) -> None:
    """--agent: checked as training's rollout.agent (read, not run; a file path made absolute); it runs each problem
    itself, so --env (other than single), --retriever and --responses contradict it."""
    from emapg_cli.rewards.plugin import check_ref

    try:
        o["agent"] = check_ref(o["agent"], "rollout.agent", "function", agent=True)
    except UserError as e:
        raise UserError(f"--agent: {str(e).removeprefix('rollout.agent: ').removeprefix('rollout.agent ')}") from None
    for flag, value in (("--env", o["env"] not in (None, "single") and o["env"]), ("--retriever", o["retriever"]),
                        ("--responses", o["responses"])):
        if value:
            raise UserError(f"--agent runs each problem itself; it contradicts {flag} {value}")


def _run_limits(cfg) -> dict:
    """What eval takes from a run's config besides its options: limits on environments, plugins and agents
    (rollout.env_timeout_s, reward.plugin_memory_mib, rollout.agent_*, reward.max_failure_rate), the chat turns before
    each question (data.chat_prefix) and the stop strings (rollout.stop)."""
    r = cfg.rollout
    return {"env_timeout_s": r.env_timeout_s, "plugin_memory_mib": cfg.reward.plugin_memory_mib,
            "chat_prefix": cfg.data.prefix_messages() or None, "stop": list(r.stop) or None,
            "agent_max_calls": r.agent_max_calls, "agent_max_tokens": r.agent_max_tokens, "agent_timeout_s": r.agent_timeout_s,
            "agent_workers": r.agent_workers, "agent_max_failure_rate": cfg.reward.max_failure_rate}


def _check_code(o: dict, typed: set[str], cfg, preset) -> None:
    """The reward's check, then the trust rule (config/trust.py): a plugin from --preset/--config runs only with
    --trust-code; it is imported now, before anything is written."""
    from emapg_cli.config.trust import code_refs_of, load_code, named_refs, require_trust
    from emapg_cli.rewards.registry import canonical_reward, check_reward

    searching = o["retriever"] is not None
    try:  # the check training's rollout.reward gets; a plugin file path is made absolute
        o["reward"] = check_reward(o["reward"] if o["reward"] is not None else ("em" if searching else "math"))
    except UserError as e:
        raise UserError(f"--reward: {e}") from None
    refs = code_refs_of(reward=o["reward"], env=o["env"], agent=o["agent"])  # the code this evaluation will import
    named = named_refs(o["set_"] or [], **{k: o[k] for k in ("reward", "env", "agent") if cfg is None or k in typed})
    source = " or ".join([*([f"--preset {preset}"] if preset else []), *([f"--config {o['config']}"] if o["config"] else [])])
    require_trust(refs, named, o["trust_code"], *([source] if source else []))  # named on this command line: trusted
    try:
        load_code(refs)
    except UserError as e:
        msg = str(e)
        for key, flag in (("rollout.reward", "--reward"), ("rollout.env", "--env"), ("rollout.agent", "--agent")):
            if msg.startswith(key):
                raise UserError(f"{flag}: {msg.removeprefix(key).lstrip(': ')}") from None
        raise
    if searching and canonical_reward(o["reward"]) == "math":
        raise UserError("--retriever answers inside <answer> tags: use --reward em or f1")


def _settings_line(s, what: str, origin: dict, threads_note: str) -> str:
    """The one line saying which settings the evaluation uses and where its sampling settings came from."""
    turn = " per turn" if s.env not in (None, "single") or s.retriever else ""
    src = lambda k: f" ({'command line' if origin[k] == 'typed' else origin[k]})"  # noqa: E731
    search = (f", retriever {s.retriever}, max turns {s.max_turns}, topk {s.topk}, observations {s.max_obs_tokens} "
              f"tokens, context {s.max_context_tokens} tokens" if s.retriever else "")
    user_env = f", env {s.env}" if s.env not in (None, "single", "search") else f", agent {s.agent}" if s.agent else ""
    prefix = f", {len(s.chat_prefix)} chat turns before each question (data.chat_prefix)" if s.chat_prefix else ""
    prefix += f", stop strings {s.stop} (rollout.stop)" if s.stop else ""
    return (f"eval settings from {what}: bench {s.bench}, n {s.n}{src('n')}, temperature {s.temperature}"
            f"{src('temperature')}, top_p {s.top_p}{src('top_p')}, max tokens {s.max_tokens}{turn}{src('max_tokens')}, "
            f"reward {s.reward}{user_env}{search}{prefix}{threads_note}")


def _cost(s, items: int, capped: bool) -> str:
    """What an evaluation may generate at most: `; at most 4 x 28,000 = 112,000 generated tokens per item, 22,400,000
    for the 200 items`, and what caps it when the 28,000 tokens are eval's default."""
    per = s.n * s.max_tokens
    line = f"; at most {s.n} x {s.max_tokens:,} = {per:,} generated tokens per item, {items * per:,} for the {items} item{'s' * (items != 1)}"
    if not capped:
        line += " (--max-tokens caps it" + ("; --preset smol evaluates reasoning-gym tasks with its chat turns and 16 "
                                            "tokens)" if s.reward == "reasoning-gym" else ")")
    return line


def _run(settings, label: str, cfg, origin: dict, what: str, typed: set[str]) -> None:
    """Say which settings the evaluation uses (`_preflight`'s results), claim the output folder, sample and grade with a
    progress bar, print the summary and draw the plots. Without a config, the settings line is printed with `_cost`,
    once the items are counted."""
    import json

    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

    from emapg_cli.evaluation.report import text_summary
    from emapg_cli.evaluation.runner import run_eval
    from emapg_cli.evaluation.store import RESULTS, RESUME_KEYS
    from emapg_cli.outputs import claim_folder, config_sha256
    from emapg_cli.plots.common import PLOTS_DIR
    from emapg_cli.plots.eval import no_curve, plot_evals
    from emapg_cli.progress import Progress

    threads_note = ""
    if settings.model is not None:  # on CPU, torch's threads chosen as `train` chooses them (EMAPG_TORCH_THREADS, train.torch_threads, auto)
        from emapg_cli.train.threads import set_torch_threads

        threads_note = set_torch_threads(cfg.train.torch_threads if cfg is not None else None)
    if cfg is not None:  # what the config gave: one line, before the work
        console.print(_settings_line(settings, what, origin, threads_note), markup=False, highlight=False, soft_wrap=True)
    intro = None  # eval's own defaults (28,000 tokens, 32 samples) can cost hours: the first line says so
    if cfg is None and settings.model is not None:  # (once the bench is read and the model found: `progress`)
        origin = {k: "typed" if k in typed else "eval's default" for k in ("n", "temperature", "top_p", "max_tokens")}
        intro = [_settings_line(settings, "the command line", origin, threads_note), "max_tokens" in typed]
    bar = Progress(
        TextColumn(escape(f"eval {label}").replace("{", "{{").replace("}", "}}")),  # TextColumn str.formats its text
        BarColumn(), MofNCompleteColumn(), TextColumn("acc {task.fields[acc]}"),
        TimeElapsedColumn(), console=console,
    )
    task = bar.add_task("eval", total=None, acc="-")

    def progress(done: int, total: int, acc: float) -> None:
        if intro:  # the first call: the bench is read and the model found, nothing generated yet
            console.print(intro[0] + _cost(settings, total, intro[1]), markup=False, highlight=False, soft_wrap=True)
            intro.clear()
        bar.update(task, completed=done, total=total, acc=f"{100 * acc:.1f}%")

    out = settings.out
    record = settings.record()
    digest = config_sha256(json.dumps({k: record.get(k) for k in RESUME_KEYS}, sort_keys=True, default=str))
    with claim_folder(out, "eval", digest, keep=(RESULTS,)), bar:
        summary = run_eval(settings, progress)
    console.print(text_summary(summary), markup=False, highlight=False, soft_wrap=True, end="")
    failed = {k: summary.get(f"grader_{k}") or 0 for k in ("errors", "timeouts", "crashes", "out_of_memory")}
    if any(failed.values()):  # each counted response scored 0: say so, not only in summary.json
        counts = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in failed.items() if v)
        typer.echo(f"warning: some responses could not be graded and scored 0 ({counts}; see summary.json grader_*)", err=True)
    drawn = plot_evals([(out.name, summary)], out / PLOTS_DIR)
    plots = f"plots in {out / PLOTS_DIR}" if drawn else no_curve([(out.name, summary)])
    console.print(f"results in {out} ({plots})", markup=False, highlight=False)


def _compare(ctx: typer.Context, folders: Optional[tuple[Path, Path]], json_out: Optional[Path]) -> None:
    """--compare A B [--json FILE] (evaluation/compare.py): one report, no sampling; any other option is refused."""
    from emapg_cli.evaluation.compare import check_json_out, compare, settings_warning, summary_lines, write_json

    if folders is None:
        raise UserError("--json writes the record of a comparison: give --compare A B")
    other = sorted(_given(ctx) - {"compare", "json_out"})
    if other:
        raise UserError(f"--compare compares two finished evaluations and takes only --json, not --{other[0].rstrip('_').replace('_', '-')}")
    if json_out is not None:  # refused before any work
        check_json_out(json_out)
    result, record = compare(*folders)
    if warning := settings_warning(record["differing_settings"]):
        typer.echo(warning, err=True)
    for line in summary_lines(result, Path(record["a"]), Path(record["b"])):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    if json_out is not None:
        write_json(json_out, record)


def eval_(
    ctx: typer.Context,
    bench: Annotated[Optional[str], typer.Option("--bench", "-b", help="Benchmark: a dataset prepared with `emapg prepare NAME`, `toy` / `toy-search` / `toy-tools` (the test set of `emapg prepare --preset NAME`), or a JSONL file / folder in the canonical schema or any layout `emapg prepare` converts (e.g. the official OlympiadBench test.jsonl, MATH-style problem/answer). Default with --preset/--config: the config's data.eval.")] = None,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Model folder (save_pretrained format; a hub id with network) to sample from.")] = None,
    responses: Annotated[Optional[Path], typer.Option("--responses", help="Grade these responses instead of sampling: JSONL rows with \"id\" and \"responses\" (a list of strings), optionally \"finish_reasons\" (\"length\" = truncated).")] = None,
    backend: Annotated[Literal["auto", "vllm", "hf"], typer.Option("--backend", help="Generation engine: vllm (a CUDA GPU, or vLLM's CPU build), hf (transformers), or auto (vllm when installed and a CUDA GPU is present).")] = "auto",
    n: Annotated[Optional[int], typer.Option("--n", min=1, help="Samples per problem (one request with n distinct per-sample seeds); default 32, or 1 with --retriever.")] = None,
    temperature: Annotated[Optional[float], typer.Option("--temperature", min=0.0, max=10.0, help="Sampling temperature (0 = greedy); default 0.8, or 0 with --retriever (Search-R1 validates greedily).")] = None,
    top_p: Annotated[float, typer.Option("--top-p", max=1.0, help="Nucleus sampling threshold, in (0, 1].")] = 0.9,
    max_tokens: Annotated[Optional[int], typer.Option("--max-tokens", min=1, help="Maximum response length in tokens; with --retriever, per turn. Default 28000, or 500 with --retriever.")] = None,
    seed: Annotated[int, typer.Option("--seed", min=0, help="Base sampling seed.")] = 429,
    limit: Annotated[Optional[int], typer.Option("--limit", min=1, help="Evaluate only the first N problems.")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Output folder (default: runs/eval/<bench>-<model name>, the model named by its run for a final/policy, by its folder for a prepared model/; the model's name alone when it starts with the bench's); rerunning with the same folder resumes.")] = None,
    instruction: Annotated[Optional[str], typer.Option("--instruction", help="Text appended to each problem (default: none, the problem alone is the user message).")] = None,
    chunk: Annotated[Optional[int], typer.Option("--chunk", min=1, help="Problems per generate call; results are saved after each (default: 512 for vllm, 64/n for hf).")] = None,
    max_model_len: Annotated[Optional[int], typer.Option("--max-model-len", min=1, help="vLLM: prompt + response token limit (default: the model's).")] = None,
    dtype: Annotated[Optional[Literal["float32", "bfloat16", "float16"]], typer.Option("--dtype", metavar="DTYPE", help="Model dtype: float32, bfloat16 or float16 (default: bfloat16 on GPU, float32 on CPU).")] = None,
    gpu_memory_utilization: Annotated[float, typer.Option("--gpu-memory-utilization", min=0.05, max=1.0, help="vLLM on a GPU: fraction of GPU memory to use (on CPU the KV cache is 1 GiB, or VLLM_CPU_KVCACHE_SPACE GiB).")] = 0.9,
    grader_workers: Annotated[Optional[int], typer.Option("--grader-workers", min=1, help="Grading processes (default: one per CPU core, at most 8).")] = None,
    reward: Annotated[Optional[str], typer.Option("--reward", help="Grading, as training's rollout.reward: math (the final \\boxed{} answer, math-verify), toy (the same), for QA / the search agent em (Search-R1 exact match) or f1 (SQuAD token F1) of the last <answer>...</answer>, exact_match, or a plugin module:function / path/to/file.py:function scoring one response (a score >= 1 counts as solved; docs/rewards.md). Default math, or em with --retriever.")] = None,
    grader_timeout: Annotated[float, typer.Option("--grader-timeout", min=0.1, help="Hard time limit in seconds per graded answer or plugin call (over it: scored wrong); at most a week.")] = 5.0,
    retriever: Annotated[Optional[str], typer.Option("--retriever", help="Answer with the search agent (Search-R1 protocol) over bm25:DIR or dense:DIR (an index from `emapg retriever index`, `--dense MODEL` for dense) or http://HOST:PORT (a Search-R1 /retrieve server, e.g. e5/FAISS on wiki-18, or `emapg retriever serve`; several, comma-separated: round-robin with failover).")] = None,
    agent: Annotated[Optional[str], typer.Option("--agent", help="An agent on an OpenAI client answers each problem, as training's rollout.agent (docs/agents.md): path/to/file.py:fn or module:fn, called fn(client, example) per sample; the reward it returns grades instead of --reward. --max-tokens is per call, --max-context-tokens each call's prompt + completion.")] = None,
    env: Annotated[Optional[str], typer.Option("--env", help="The environment the model answers in, built by training's factory (rollout.env): single (default), search (needs --retriever, which alone implies it), calc (the toy arithmetic calculator), or a user environment path/to/file.py:ClassName / module:ClassName (docs/environments.md); its own reward(text), when it has one, grades instead of --reward.")] = None,
    max_turns: Annotated[Optional[int], typer.Option("--max-turns", min=0, help="With --retriever: search turns per question, then one final turn without search (0 = search disabled; default 4, search.max_turns). With a user --env: its turn limit (default: the class's max_turns).")] = None,
    topk: Annotated[int, typer.Option("--topk", min=1, help="With --retriever: passages per search.")] = 3,
    max_obs_tokens: Annotated[int, typer.Option("--max-obs-tokens", min=1, help="With --retriever: observations are cut to their first this many tokens.")] = 500,
    max_context_tokens: Annotated[int, typer.Option("--max-context-tokens", min=2, help="With --retriever or a user --env: prompt + trajectory token limit.")] = 4096,
    prompt_template: Annotated[Optional[Path], typer.Option("--prompt-template", help="With --retriever: user-message template file with a {question} placeholder (default: Search-R1's prompt).")] = None,
    truncated: Annotated[Literal["zero", "grade"], typer.Option("--truncated", help="A response cut at the token cap: `zero` scores it 0 and it casts no maj@n vote (the paper's rule), `grade` grades it.")] = "zero",
    think: Annotated[Literal["emapg", "paper"], typer.Option("--think", help="Where the answer is looked for: `emapg` after the last </think> (else everywhere), `paper` after </think> only when there is exactly one (else everywhere).")] = "emapg",
    trust_code: Annotated[bool, typer.Option("--trust-code", help="Run a reward plugin / user environment / agent that a config file names; one named by --reward / --env / --agent on this command line always runs (docs/reliability.md).")] = False,
    preset: PresetOpt = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    compare: Annotated[Optional[tuple[Path, Path]], typer.Option("--compare", help="Compare two finished evaluations of the same items instead of evaluating: A B, each an `emapg eval` output folder or an `emapg train` run folder (its final evaluation). Prints the paired difference of the per-item scores with a bootstrap interval, McNemar's exact test (0/1 scores) or a paired permutation test, the discordant counts and a one-line verdict (docs/eval.md).", show_default=False)] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="With --compare: also write every number of the comparison to this JSON file.")] = None,
) -> None:
    """Sample --n responses per problem (or read --responses), grade them (--reward), write results.jsonl, summary.json and summary.md.
    With --compare A B, compare two finished evaluations item by item instead (nothing is sampled).

    With --preset/--config/--set (resolved as `train` resolves them) the evaluation takes the run's settings: the
    environment (rollout.env, the search section's retriever, turns, topk, observation and context limits, prompt
    template), the reward, data.eval as --bench, the chat turns before each question (data.chat_prefix), the stop
    strings (rollout.stop) and the `eval` section's sampling (n, temperature, top_p, max_new_tokens per turn), so `emapg eval --preset toy-search --model runs/RUN/final/policy` scores what the run's
    final evaluation scored. Precedence: an eval option typed on the command line > --set > --config > --preset
    (there the config's defaults fill what the files leave out, e.g. the `eval` section's n, temperature, top_p).
    With --set alone (no --preset/--config) an option takes the config's value only when a --set item names its key;
    the others keep eval's own defaults (n 32, temperature 0.8, top_p 0.9, max tokens 28000; with a retriever n 1,
    temperature 0, 500 tokens per turn). The settings line says where n, temperature, top_p and max tokens came from.
    The result passes the checks `train` runs on its config (one line, exit 2).
    """
    if compare is not None or json_out is not None:
        return _compare(ctx, compare, json_out)
    from emapg_cli.hf_quiet import quiet_transformers

    quiet_transformers()
    _run(*_preflight(ctx), typed=_given(ctx))


def _preflight(ctx: typer.Context):
    """Every check `eval` can fail before any work, in order, one line each (exit 2): options, config, environment,
    reward, trust. Returns `_run`'s (EvalSettings, the bench, the config or None, each option's origin, its source)."""
    from emapg_cli.evaluation.naming import BUILTIN_BENCHES, bench_ref, default_out
    from emapg_cli.evaluation.runner import EvalSettings
    from emapg_cli.tasks import TASKS

    bench, preset, config, set_, env, retriever, model, responses, out = (ctx.params[k] for k in (
        "bench", "preset", "config", "set_", "env", "retriever", "model", "responses", "out"))
    check_seconds_option("--grader-timeout", ctx.params["grader_timeout"])
    o, cfg, origin = dict(ctx.params), None, {}
    if bench in BUILTIN_BENCHES and TASKS[bench].env and not (preset or config or env or retriever):
        preset = bench  # a toy with an environment (search agent, calculator): evaluated as its preset trains it
    label = bench  # names the default output folder
    if preset or config or set_:
        cfg, implied, origin = _from_config(ctx, preset, config, set_)
        label = bench or cfg.name  # runs/eval/<run name>-<model>: data.eval is often a file called test.jsonl
        o.update(implied)
        if o["env"] == "single" or (o["env"] == "search" and o["retriever"] is not None):
            o["env"] = None  # as without a config: the default, or the search agent the retriever implies
    if o["bench"] is None:
        raise UserError("give --bench (or --preset/--config whose data.eval names the evaluation set)")
    if o["top_p"] <= 0:
        raise UserError(f"--top-p must be in (0, 1], got {o['top_p']}")
    if model is None and responses is None:
        raise UserError("give --model (sample and grade) or --responses (grade given responses)")
    if responses is not None and not responses.is_file():
        raise UserError(f"{responses}: no such file")
    _check_env_options(o)
    _check_code(o, _given(ctx), cfg, preset)
    if o["retriever"] is not None or o["env"] not in (None, "single", "search") or o["agent"] is not None:
        from emapg_cli.evaluation.search import check_turn_budget

        check_turn_budget(o["max_tokens"], o["max_context_tokens"])
    keys = ("backend", "n", "temperature", "top_p", "max_tokens", "seed", "limit", "instruction", "chunk", "max_model_len",
            "dtype", "gpu_memory_utilization", "grader_workers", "grader_timeout", "reward", "retriever", "env",
            "agent", "max_turns", "topk", "max_obs_tokens", "max_context_tokens", "truncated", "think")
    settings = EvalSettings(
        bench=bench_ref(o["bench"]), out=out or default_out(label or o["bench"], model, responses), model=model,
        responses_file=responses, prompt_template=str(o["prompt_template"]) if o["prompt_template"] else None,
        **{k: o[k] for k in keys}, **(_run_limits(cfg) if cfg is not None else {}),
    )
    what = f"--preset {preset}" if preset else f"--config {config}" if config else "--set"
    return settings, o["bench"], cfg, origin, what
