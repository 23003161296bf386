"""Shared fixtures: tiny local models, the real benchmark folder, an isolated EMAPG_HOME, CLI runner."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _leave_no_global_state():
    """Every test leaves the process as it found it (tests/process_state.py): registries (rewards, environments,
    estimators, ...), plugin caches, the environment, the working directory and torch's threads are put back after
    it, so a serial `pytest -q` gives each test what it would get alone. A module-level container of emapg_cli that
    the test changed and the restore does not cover fails the test, naming it (add it to process_state.REGISTRIES)."""
    import process_state

    state, before = process_state.snapshot(), process_state.containers()
    yield
    process_state.restore(state)
    leaked = process_state.changed_containers(before, process_state.containers())
    if leaked:
        pytest.fail(f"the test changed process-wide state that tests/process_state.py does not restore: {', '.join(leaked)}")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """A tiny random Llama model + byte tokenizer with a chat template, saved locally (built once)."""
    from emapg_cli.models.tiny import save_tiny

    return save_tiny(tmp_path_factory.mktemp("tiny_llama") / "model", arch="llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    """A tiny random Qwen2 model + byte tokenizer with a chat template, saved locally (built once)."""
    from emapg_cli.models.tiny import save_tiny

    return save_tiny(tmp_path_factory.mktemp("tiny_qwen2") / "model", arch="qwen2")


@pytest.fixture
def one_torch_thread():
    """One torch thread for the test (tiny matmuls: faster, and immune to other processes on the cores)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def shared_data() -> Path:
    """The real benchmark folder ($EMAPG_DATA_DIR); the test is skipped when it is absent."""
    from eval_helpers import data_dir

    path = data_dir()
    if path is None:
        pytest.skip("EMAPG_DATA_DIR not set or missing: real benchmark files unavailable")
    return path


@pytest.fixture
def emapg_home(tmp_path, monkeypatch) -> Path:
    """An empty, isolated EMAPG_HOME for this test (also seen by CLI subprocesses)."""
    home = tmp_path / "emapg_home"
    home.mkdir()
    monkeypatch.setenv("EMAPG_HOME", str(home))
    return home


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the real CLI (`python -m emapg_cli ...`) in a subprocess and capture its output."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "emapg_cli", *args],
        cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout,
    )


def run_cli_many(*calls: tuple[str, ...], timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """Independent `run_cli(*call)` runs, two at a time, one torch thread each, results in the order given. CI has
    two cores and the test process sits idle while it waits on a subprocess; every run starts its own interpreter
    (torch, transformers: seconds before it does anything), so two at a time nearly halves the wall time."""
    from concurrent.futures import ThreadPoolExecutor

    one_thread = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda call: run_cli(*call, env=one_thread, timeout=timeout), calls))


@pytest.fixture
def cli():
    """The `run_cli` helper as a fixture."""
    return run_cli


@pytest.fixture
def cli_many():
    """The `run_cli_many` helper as a fixture: independent CLI runs two at a time."""
    return run_cli_many


def pytest_addoption(parser):
    parser.addoption("--shuffle-seed", type=int, default=None, metavar="SEED",
                     help="run the collected tests in a random order drawn from SEED, across files (.ci/run: a test "
                          "that depends on what an earlier one left behind fails; the seed replays the order)")


def pytest_collection_modifyitems(config, items):
    seed = config.getoption("--shuffle-seed")
    if seed is not None:
        import random

        random.Random(seed).shuffle(items)


def pytest_report_header(config):
    seed = config.getoption("--shuffle-seed")
    return None if seed is None else f"test order shuffled: --shuffle-seed {seed}"


def pytest_configure(config):
    """Under pytest-xdist (`-n 2`, as CI runs): each worker gets its own EMAPG_HOME, a subfolder of the given one,
    so two workers never prepare, index or build into the same folder at once (each test's own `emapg_home` is
    still a fresh folder of its own)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        from emapg_cli.paths import emapg_home

        home = emapg_home() / f"pytest-{worker}"
        home.mkdir(parents=True, exist_ok=True)
        os.environ["EMAPG_HOME"] = str(home)


_WORKER_FUZZ: Counter = Counter()  # the controller's sum of every xdist worker's fuzz counts


def pytest_sessionfinish(session):
    """An xdist worker hands its fuzz counts to the controller (`workeroutput`), which prints the summary."""
    fuzz = sys.modules.get("test_fuzz_cli")
    if hasattr(session.config, "workeroutput") and fuzz is not None:
        session.config.workeroutput["fuzz_results"] = [[*key, n] for key, n in fuzz.RESULTS.items()]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """(xdist controller) Add up a finished worker's fuzz counts."""
    for *key, n in getattr(node, "workeroutput", {}).get("fuzz_results", []):
        _WORKER_FUZZ[tuple(key)] += n


def pytest_terminal_summary(terminalreporter):
    """The fuzz suite's case counts per command (tests/test_fuzz_cli.py), when it ran (in this process or in
    xdist workers)."""
    fuzz = sys.modules.get("test_fuzz_cli")
    results = _WORKER_FUZZ + (fuzz.RESULTS if fuzz is not None else Counter())
    if not results:
        return
    import fuzz_corpus  # (tests/ is on sys.path, as for the test modules)

    terminalreporter.section("fuzz cases per command")
    for command in fuzz_corpus.COMMANDS:
        parts = []
        for how in ("in-process", "subprocess", "generated"):
            counts = {o: results[(command, how, o)] for o in ("ok", "xfail", "fail")}
            if any(counts.values()):
                parts.append(f"{how} {sum(counts.values())} (ok {counts['ok']}, xfail {counts['xfail']}, fail {counts['fail']})")
        if parts:
            terminalreporter.write_line(f"{command:9s} " + "; ".join(parts))
    total = sum(results.values())
    terminalreporter.write_line(f"total     {total} case runs")
