"""Untrusted model output and bad input files, through the real CLI: one line on stderr, exit 2,
nothing half-written (docs/reliability.md, "Grading untrusted model output and reading input files")."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from emapg_cli.datasets.loading import load_examples
from emapg_cli.errors import UserError


def _one_line_error(r, *needles: str) -> None:
    """Exit 2, exactly one line on stderr, no traceback, every needle in it."""
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def _jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture
def bench(tmp_path) -> Path:
    return _jsonl(tmp_path / "bench.jsonl", [{"id": i, "question": f"{i}+{i}?", "answers": [str(2 * int(i))]} for i in "123"])


# --- grading untrusted output ------------------------------------------------------------------------------


def test_two_megabyte_response_grades_wrong_within_the_timeout(bench, tmp_path, cli):
    # The probe: 171.6 s with --grader-timeout 1 (a quadratic strip outside the pool). Now the box is
    # over MAX_ANSWER_CHARS, so it is no answer: never parsed, scored wrong, grading time honest.
    given = _jsonl(tmp_path / "given.jsonl", [{"id": "1", "responses": ["\\boxed{1" + " ." * 1_000_000 + "}", "\\boxed{2}"]}])
    out = tmp_path / "out"
    t0 = time.perf_counter()
    r = cli("eval", "--bench", str(bench), "--responses", str(given), "--grader-timeout", "1", "--grader-workers", "1", "--out", str(out))
    wall = time.perf_counter() - t0
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    row = json.loads((out / "results.jsonl").read_text())
    assert row["correct"] == [False, True] and row["extracted"][0] is None
    assert summary["avg@n"] == 0.5 and summary["grading_time_s"] < 5
    assert summary["grader_timeouts"] == 0 and summary["grader_refused"] == 0
    assert wall < 60  # the CLI's start-up included; ~0.05 s of it is grading (<= 5 s wall idle, see docs)


def test_towers_are_refused_and_counted(bench, tmp_path, cli):
    given = _jsonl(tmp_path / "given.jsonl", [{"id": "1", "responses": ["\\boxed{2^{2^{40}}}", "\\boxed{10^{10^{10^{10}}}}", "\\boxed{2}"]}])
    out = tmp_path / "out"
    r = cli("eval", "--bench", str(bench), "--responses", str(given), "--grader-timeout", "1", "--grader-workers", "1", "--out", str(out))
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["grader_refused"] == 2 and summary["grader_timeouts"] == 0
    assert json.loads((out / "results.jsonl").read_text())["correct"] == [False, False, True]


# --- duplicate ids -----------------------------------------------------------------------------------------


def test_duplicate_ids_are_errors(tmp_path, cli):
    dup = _jsonl(tmp_path / "dup.jsonl", [{"id": "a", "question": "q1", "answers": ["1"]}, {"id": "a", "question": "q2", "answers": ["2"]},
                                          {"id": "b", "question": "q3", "answers": ["3"]}])
    with pytest.raises(UserError, match=r"dup.jsonl:2: duplicate id 'a'"):  # training data reads the same way
        load_examples(str(dup))
    out = tmp_path / "out"
    given = _jsonl(tmp_path / "given.jsonl", [{"id": "a", "responses": ["\\boxed{1}"]}])
    _one_line_error(cli("eval", "--bench", str(dup), "--responses", str(given), "--out", str(out)), "dup.jsonl:2", "duplicate id 'a'")
    assert not out.exists()


def test_duplicate_response_rows_are_errors(bench, tmp_path, cli):
    given = _jsonl(tmp_path / "given.jsonl", [{"id": "1", "responses": ["\\boxed{2}"]}, {"id": "1", "responses": ["\\boxed{3}"]}])
    out = tmp_path / "out"
    _one_line_error(cli("eval", "--bench", str(bench), "--responses", str(given), "--out", str(out)), "given.jsonl:2", "duplicate id '1'")
    assert not out.exists()


# --- malformed input files ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content, needle",
    [
        (b'{"id": "1", "responses": ["\\\\boxed{2}"]}\n\xff\xfe junk\n', "given.jsonl:2: not UTF-8"),
        (b'["not", "an", "object"]\n', "given.jsonl:1: expected a JSON object, got list"),
        (b'{"id": "1", "responses": ["\\ud800"]}\n', "given.jsonl:1: holds a lone surrogate"),
        (b'{"id": "1", "responses": [\n', "given.jsonl:1: not valid JSON"),
    ],
)
def test_bad_responses_files(bench, tmp_path, cli, content, needle):
    given = tmp_path / "given.jsonl"
    given.write_bytes(content)
    out = tmp_path / "out"
    _one_line_error(cli("eval", "--bench", str(bench), "--responses", str(given), "--out", str(out)), needle)
    assert not out.exists()  # nothing half-made


def test_bad_bench_file(tmp_path, cli):
    bad = tmp_path / "bench.jsonl"
    bad.write_bytes(b'{"id": "1", "question": "q", "answers": ["1"]}\n7\n')
    given = _jsonl(tmp_path / "given.jsonl", [{"id": "1", "responses": ["\\boxed{1}"]}])
    _one_line_error(cli("eval", "--bench", str(bad), "--responses", str(given), "--out", str(tmp_path / "o")), "bench.jsonl:2", "got int")


@pytest.mark.parametrize(
    "corrupt, needle",
    [
        ('{"id": "2", "responses": ["x"]}\n', "results.jsonl:2: not a result row"),
        ('[1, 2]\n', "results.jsonl:2: expected a JSON object"),
        ('{"id": "1", "responses": ["x"], "extracted": [null], "correct": [false], "strict": [false]}\n', "results.jsonl:2: duplicate id"),
    ],
)
def test_corrupt_result_rows_of_a_resumable_eval(bench, tmp_path, cli, corrupt, needle):
    given = _jsonl(tmp_path / "given.jsonl", [{"id": "1", "responses": ["\\boxed{2}"]}])
    out = tmp_path / "out"
    args = ("eval", "--bench", str(bench), "--responses", str(given), "--grader-workers", "1", "--out", str(out))
    r = cli(*args)
    assert r.returncode == 0, r.stderr
    _jsonl(given, [{"id": i, "responses": [f"\\boxed{{{2 * int(i)}}}"]} for i in "123"])  # the rerun resumes
    results = out / "results.jsonl"
    results.write_text(results.read_text() + corrupt)
    before = results.read_bytes()
    _one_line_error(cli(*args), needle)
    assert results.read_bytes() == before  # the evidence is left as it was


def test_corrupt_run_json(bench, tmp_path, cli):
    out = tmp_path / "out"
    out.mkdir()
    (out / "run.json").write_text("[not json")
    (out / "results.jsonl").write_text("")  # an eval folder (of a version before output markers) whose run.json is damaged
    given = _jsonl(tmp_path / "given.jsonl", [{"id": "1", "responses": ["\\boxed{2}"]}])
    _one_line_error(cli("eval", "--bench", str(bench), "--responses", str(given), "--out", str(out)), "run.json", "corrupt")


def test_bad_parquet_and_non_utf8_json(tmp_path, emapg_home, cli):
    bad = tmp_path / "rows.parquet"
    bad.write_bytes(b"PAR1 this is not parquet")
    _one_line_error(cli("prepare", "mine", "--from", str(bad)), "rows.parquet", "not a readable parquet file")
    latin = tmp_path / "rows.json"
    latin.write_bytes('[{"question": "caf\xe9", "answer": "1"}]'.encode("latin-1"))
    _one_line_error(cli("prepare", "mine", "--from", str(latin)), "rows.json", "not UTF-8")
    assert not (emapg_home / "data" / "mine").exists()


def test_markup_in_data_is_printed_as_text(tmp_path, emapg_home, cli):
    # The probe: id "[/bold]" raised MarkupError after prepare had written its data.
    src = _jsonl(tmp_path / "rows.jsonl", [{"id": "[/bold]", "question": "q [red]1", "answer": "1"},
                                           {"id": "[/bold]", "question": "q2", "answer": "2"}])
    r = cli("prepare", "mine", "--from", str(src))
    assert r.returncode == 0, r.stderr
    assert "(id [/bold]): duplicate" in r.stdout


def test_offline_hub_is_one_line(tmp_path, emapg_home, cli):
    # A stand-in `datasets` package whose load_dataset fails like an offline machine's.
    fake = tmp_path / "fake" / "datasets"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "def load_dataset(*a, **k):\n    raise ConnectionError(\"Couldn't reach 'Maxwell-Jia/AIME_2024' on the Hub (LocalEntryNotFoundError)\\nmore\")\n"
    )
    import os

    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(fake.parent), os.environ.get("PYTHONPATH")])), "HF_HUB_OFFLINE": "1"}
    r = cli("prepare", "aime24", env=env)
    _one_line_error(r, "aime24", "ConnectionError", "network", "--from FILE")
    assert not (emapg_home / "data" / "aime24").exists()


# --- kl-check ----------------------------------------------------------------------------------------------


def test_kl_check_huge_logits_and_sizes(tmp_path, cli):
    import numpy as np

    p = np.full((4, 50), 1e308)
    p[:, ::2] = -1e308  # was a ZeroDivisionError deep in the t-test
    np.savez(tmp_path / "big.npz", policy=p, anchor=-p)
    _one_line_error(cli("kl-check", "--from-logits", str(tmp_path / "big.npz")), "big.npz", "'policy'", "magnitude 1e+308")
    t0 = time.perf_counter()  # was OOM-killed after 104 s with no message
    _one_line_error(cli("kl-check", "--vocab", "2000000000"), "2000000000", "GiB", "--vocab")
    _one_line_error(cli("kl-check", "--samples", "20000000000"), "20000000000 samples", "GiB", "--samples")
    assert time.perf_counter() - t0 < 60


def test_kl_check_text_not_utf8(tmp_path, cli):
    text = tmp_path / "t.txt"
    text.write_bytes(b"caf\xe9\n")
    _one_line_error(cli("kl-check", "--model", str(tmp_path / "no-model"), "--text", str(text)), "t.txt", "not UTF-8")


def test_ctrl_c_during_grading_prints_no_worker_traceback(bench, tmp_path):
    # The probe: Ctrl-C made every grading worker print a KeyboardInterrupt traceback. SIGINT goes
    # to the whole process group, as a terminal sends it.
    import os
    import signal
    import subprocess
    import sys

    # Answers that pass every cheap check and keep sympy busy for seconds each; all distinct, so that no
    # cache or dedup can settle them at once and the grading still runs when SIGINT arrives.
    slow = [f"\\boxed{{(x+{k})^{{{1000 + k}}}}}" for k in range(24)]
    given = _jsonl(tmp_path / "given.jsonl", [{"id": i, "responses": slow[8 * j:8 * j + 8]} for j, i in enumerate("123")])
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "emapg_cli", "eval", "--bench", str(bench), "--responses", str(given), "--grader-workers", "2",
         "--grader-timeout", "30", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        # As in a terminal's foreground: SIGINT at its default. A shell without job control starts background
        # commands with SIGINT ignored, Python keeps an inherited SIG_IGN, and so would eval (it then grades on,
        # as `nohup` asks), which once made this test wait out every slow answer.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 120
    while not (out / "run.json").exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    time.sleep(8)  # the workers start and take their first answers
    os.killpg(proc.pid, signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: nothing else would stop it and its workers
        proc.communicate()
        pytest.fail("eval did not exit within 120 s of SIGINT")
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
