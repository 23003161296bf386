"""Readers: every file or option emapg reads is checked where it is read, and a bad one is one line (issue 20).

`plot` (metrics.jsonl rows, summary.json), `kl-check --from-logits` (the .npy headers in the zip, before any
array is decompressed), `bench` options, `lora.r`, `eval --responses` / `--prompt-template`, and ids too long
for Python's int-from-text limit in bench, responses and `prepare` inputs.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from . import probe
from .common import Result, base_env, emapg, ok, one_line_error

BENCH = "".join(json.dumps({"id": str(i), "question": f"What is {i}+{i}?", "answers": [str(2 * i)]}) + "\n" for i in range(3))
HUGE_ID = "9" * 5000  # > Python's 4300-digit int <-> str limit: json.loads raises ValueError, not JSONDecodeError


def _write(path: Path, content: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    return path


def _run_rss(ws: Path, *argv: str, timeout: float = 60) -> tuple[Result, float]:
    """`emapg ARGV` as a subprocess; (result, its own peak resident memory in MiB, from wait4)."""
    import tempfile

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        p = subprocess.Popen([sys.executable, "-m", "emapg_cli", *argv], cwd=ws, env=base_env(ws), stdout=out, stderr=err)
        import time

        deadline = time.monotonic() + timeout
        while True:
            pid, status, usage = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                p.kill()
                os.wait4(p.pid, 0)
                raise AssertionError(f"`emapg {' '.join(argv)[:200]}` ran past {timeout:.0f} s")
            time.sleep(0.05)
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return Result(p.returncode, out.read().decode(errors="replace"), err.read().decode(errors="replace")), usage.ru_maxrss / 1024


# ---------------------------------------------------------------------------------------------- plot

GOOD_ROW = {"step": 0, "reward/mean": 0.5, "kl/value": 0.01}
#: metrics.jsonl rows a run never writes (tampered, or another tool's file): each is skipped and counted.
BAD_METRIC_ROWS = {
    "list": "[1, 2]",
    "string": '"step"',
    "number": "3",
    "null": "null",
    "no-step": '{"reward/mean": 0.5}',
    "step-string": '{"step": "one", "reward/mean": 0.5}',
    "step-float": '{"step": 1.5, "reward/mean": 0.5}',
    "step-negative": '{"step": -1, "reward/mean": 0.5}',
    "step-bool": '{"step": true, "reward/mean": 0.5}',
    "step-nan": '{"step": NaN, "reward/mean": 0.5}',
    "step-1e400": '{"step": 1e400, "reward/mean": 0.5}',
    "step-5000-digits": '{"step": ' + HUGE_ID + ', "reward/mean": 0.5}',
    "nested": "[" * 100_000 + "]" * 100_000,
    "not-utf8": b'{"step": 1, "reward/mean": "\xff"}',
}


@probe("plot_metrics_malformed_rows")
def plot_metrics_malformed_rows(ws: Path) -> None:
    """A user plots runs whose metrics.jsonl holds one malformed row each (a list, a string, a number, a
    missing / string / float / negative / boolean / NaN / 1e400 / 5000-digit step, deep nesting, non-UTF-8
    bytes) next to a good one: the plot is drawn (exit 0), each run's bad row skipped with a warning that counts it."""
    runs = []
    for name, bad in BAD_METRIC_ROWS.items():
        raw = bad if isinstance(bad, bytes) else bad.encode()
        _write(ws / name / "metrics.jsonl", json.dumps(GOOD_ROW).encode() + b"\n" + raw + b"\n")
        runs.append(name)
    r = ok(emapg(ws, "plot", *runs, "--out", "plots"))
    warnings = [ln for ln in r.err.splitlines() if ln.startswith("warning: ")]
    for name in runs:
        hits = [ln for ln in warnings if f"{name}/metrics.jsonl" in ln]
        assert hits and "skipped 1 " in hits[0], f"no warning counting the bad row of {name}: {r.show()}"
    assert (ws / "plots" / "training.png").is_file(), f"no training.png: {r.show()}"


@probe("plot_metrics_odd_values_and_repeats")
def plot_metrics_odd_values_and_repeats(ws: Path) -> None:
    """A run's rows hold metric values that are strings, objects, null, booleans, 1e400 (inf), and a step
    logged twice: non-numbers are not drawn, the repeated step is counted in a warning, exit 0."""
    rows = [GOOD_ROW, {"step": 1, "reward/mean": "0.7", "kl/value": {"a": 1}, "entropy": None, "clip/frac": True},
            {"step": 1, "reward/mean": 0.6}]
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 2, "reward/mean": 1e400}\n'
    _write(ws / "run" / "metrics.jsonl", text)
    r = ok(emapg(ws, "plot", "run"))
    assert "repeat an earlier step" in r.err, f"repeated step not reported: {r.show()}"
    assert (ws / "plots" / "training.png").is_file(), f"no plots in ./plots: {r.show()}"  # `emapg plot RUN` writes ./plots
    assert not (ws / "plots" / "clip_fraction.png").exists(), f"a boolean was drawn as a number: {r.show()}"


@probe("plot_metrics_bom")
def plot_metrics_bom(ws: Path) -> None:
    """A metrics.jsonl saved by an editor with a UTF-8 byte-order mark: its first row is read like the others."""
    _write(ws / "run" / "metrics.jsonl", b"\xef\xbb\xbf" + json.dumps(GOOD_ROW).encode() + b"\n")
    r = ok(emapg(ws, "plot", "run"))
    assert "warning" not in r.err, f"the row after the BOM was skipped: {r.show()}"


@probe("plot_metrics_binary_file")
def plot_metrics_binary_file(ws: Path) -> None:
    """metrics.jsonl is binary garbage (not UTF-8): exit 2, one line (nothing to plot), after the warning."""
    _write(ws / "run" / "metrics.jsonl", bytes(range(128, 256)) * 4)
    one_line_error(emapg(ws, "plot", "run"), "nothing to plot")


#: summary.json contents `emapg eval` never writes: each is one line, exit 2.
BAD_SUMMARIES = {
    "list": ("[1, 2]", "JSON object"),
    "string": ('"pass@1"', "JSON object"),
    "pass-at-word": ('{"pass@one": 0.5}', "pass@one"),
    "pass-at-string": ('{"pass@1": "0.5"}', "pass@1"),
    "pass-at-inf": ('{"pass@1": 1e400}', "pass@1"),
    "maj-string": ('{"pass@1": 0.5, "maj@n": "x"}', "maj@n"),
    "subsets-list": ('{"pass@1": 0.5, "subsets": ["a"]}', "subsets"),
    "subset-number": ('{"pass@1": 0.5, "subsets": {"a": 5}}', "subsets"),
    "subset-avg-string": ('{"pass@1": 0.5, "subsets": {"a": {"avg@n": "x", "num_items": 1}}}', "avg@n"),
    "sources-items-string": ('{"pass@1": 0.5, "sources": {"a": {"avg@n": 0.5, "num_items": "3"}}}', "num_items"),
    "huge-int": ('{"pass@1": ' + HUGE_ID + "}", "integer"),
    "not-utf8": (b'{"pass@1": 0.5, "n": "\xff"}', "UTF-8"),
}


@probe("plot_summary_malformed")
def plot_summary_malformed(ws: Path) -> None:
    """A user plots eval folders whose summary.json is not an object, has non-numeric or out-of-range pass@k /
    maj@n, wrongly typed subsets / sources, a 5000-digit number or non-UTF-8 bytes: exit 2, one line naming the field."""
    for name, (content, needle) in BAD_SUMMARIES.items():
        _write(ws / name / "summary.json", content if isinstance(content, bytes) else content.encode())
        _write(ws / name / "results.jsonl", "")
        one_line_error(emapg(ws, "plot", name), f"{name}/summary.json", needle)
        assert not (ws / name / "plots").exists() and not (ws / "plots").exists(), f"{name}: plots written for a refused summary"


# ------------------------------------------------------------------------------------- kl-check npz

def _npy_header(shape: tuple[int, ...], descr: str = "<f8") -> bytes:
    from numpy.lib import format as npy

    buf = io.BytesIO()
    npy.write_array_header_1_0(buf, {"descr": descr, "fortran_order": False, "shape": shape})
    return buf.getvalue()


def _npz_stream(path: Path, arrays: dict[str, tuple]) -> Path:
    """An .npz whose arrays are zeros of the given shapes (float64, or (shape, None, descr)), deflated while
    written (no big buffer in memory); (shape, raw) writes `raw` after the header instead (a member of
    another size than its header says)."""
    import numpy as np

    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, (shape, raw, *descr) in arrays.items():
            with zf.open(name + ".npy", "w", force_zip64=True) as f:
                f.write(_npy_header(shape, *descr))
                if raw is not None:
                    f.write(raw)
                    continue
                left = int(np.prod(shape)) * np.dtype(descr[0] if descr else "<f8").itemsize
                block = bytes(1 << 22)
                while left > 0:
                    f.write(block[: min(left, len(block))])
                    left -= len(block)
    return path


@probe("klcheck_npz_bombs_refused_before_loading", slow=True)
def klcheck_npz_bombs_refused_before_loading(ws: Path) -> None:
    """Small .npz files inflating to 96 MiB arrays: both arrays with --samples too many for memory, a policy
    [2, 8] next to an anchor of another shape, an int8 anchor: each refused with one line from the .npy
    headers, without decompressing anything (peak memory stays < 64 MiB over a baseline run)."""
    big = (384, 32768)  # x 8 B = 96 MiB
    _npz_stream(ws / "bomb.npz", {"policy": (big, None), "anchor": (big, None)})
    _npz_stream(ws / "shape.npz", {"policy": ((2, 8), bytes(128)), "anchor": (big, None)})
    _npz_stream(ws / "int8.npz", {"policy": ((2, 8), bytes(128)), "anchor": ((384, 262144), None, "|i1")})
    _, base_mib = _run_rss(ws, "kl-check", "--from-logits", "missing.npz")
    for name, extra, needles in (("bomb.npz", ("--samples", "100000000"), ("GiB",)), ("shape.npz", (), ("(384, 32768)", "(2, 8)")),
                                 ("int8.npz", (), ("'anchor'", "float", "int8"))):
        r, mib = _run_rss(ws, "kl-check", "--from-logits", name, *extra)
        one_line_error(r, name, *needles)
        assert mib < base_mib + 64, f"{name}: peak memory {mib:.0f} MiB (baseline {base_mib:.0f} MiB): an array was decompressed"


@probe("klcheck_npz_header_lies")
def klcheck_npz_header_lies(ws: Path) -> None:
    """An .npz whose policy header declares [8192, 65536] float64 (4 GiB) but whose member holds 16 bytes:
    one line naming the array, its declared shape and the member's real size (nothing allocated); a
    truncated .npz: one line, not a zip."""
    _npz_stream(ws / "lie.npz", {"policy": ((8192, 65536), bytes(16)), "anchor": ((8192, 65536), bytes(16))})
    one_line_error(emapg(ws, "kl-check", "--from-logits", "lie.npz"), "'policy'", "(8192, 65536)", "holds")
    # and a valid .npz cut in half (an interrupted copy): one line saying it is not a readable zip
    _npz_stream(ws / "full.npz", {"policy": ((4, 8), None), "anchor": ((4, 8), None)})
    _write(ws / "cut.npz", (ws / "full.npz").read_bytes()[:200])
    one_line_error(emapg(ws, "kl-check", "--from-logits", "cut.npz"), "cut.npz", "zip")


class _Pwn:
    def __init__(self, target: str):
        self.target = target

    def __reduce__(self):
        return (os.mkdir, (self.target,))


@probe("klcheck_npz_object_array")
def klcheck_npz_object_array(ws: Path) -> None:
    """policy is an object array (a pickle that would create a folder): one line saying it must hold floats;
    the pickle is never loaded (allow_pickle stays False) and the folder never appears."""
    import pickle

    payload = pickle.dumps(_Pwn(str(ws / "pwned")), protocol=2)
    with zipfile.ZipFile(ws / "obj.npz", "w") as zf:
        zf.writestr("policy.npy", _npy_header((1, 2), "|O") + payload)
        zf.writestr("anchor.npy", _npy_header((1, 2)) + bytes(16))
    one_line_error(emapg(ws, "kl-check", "--from-logits", "obj.npz"), "'policy'", "float")
    assert not (ws / "pwned").exists(), "the pickle inside the .npz was executed"


# ---------------------------------------------------------------------------------------------- bench

@probe("bench_options_bounded")
def bench_options_bounded(ws: Path) -> None:
    """`bench update` / `bench passes` with --vocab 10^10 (and 1e10, -1, nan), --tokens 10^9, --hidden 10^11,
    --threads 10^11, --budget-mib inf, --k 10^12: one line at option time, exit 2, before any tensor is made."""
    for argv in (("update", "--vocab", "10000000000"), ("update", "--vocab", "1e10"), ("update", "--vocab", "-1"),
                 ("update", "--vocab", "nan"), ("update", "--tokens", "1000000000"), ("passes", "--hidden", "100000000000"),
                 ("update", "--threads", "99999999999"), ("update", "--budget-mib", "inf"), ("update", "--k", "1000000000000"),
                 ("passes", "--chunk", "1000000000000")):
        one_line_error(emapg(ws, "bench", *argv, "--repeats", "1", timeout=30), argv[1])


@probe("bench_memory_checked_up_front")
def bench_memory_checked_up_front(ws: Path) -> None:
    """`bench update` with every size within its bound but together far beyond memory (T 2^20, H 2^16,
    V 2^24): one line saying how much memory it needs, before allocating."""
    r = emapg(ws, "bench", "update", "--tokens", "1048576", "--hidden", "65536", "--vocab", "16777216", "--repeats", "1", timeout=60)
    one_line_error(r, "GiB")


# ----------------------------------------------------------------------------------------------- lora

@probe("lora_rank_bounded_in_config")
def lora_rank_bounded_in_config(ws: Path) -> None:
    """`lora.r = 10^6`: `config show` and `train --dry-run` refuse it with one line naming lora.r (the run
    used to allocate > 6.9 GB before failing, while the dry run estimated 59 MB)."""
    one_line_error(emapg(ws, "config", "show", "--preset", "toy", "--set", "lora.r=1000000"), "lora.r")
    one_line_error(emapg(ws, "train", "--preset", "toy", "--set", "lora.r=1000000", "--dry-run"), "lora.r")


# ------------------------------------------------------------------------------------- eval, prepare

@probe("eval_ragged_responses")
def eval_ragged_responses(ws: Path) -> None:
    """--responses with 4 responses for item 0 and 1 for item 1 (reported as `n: 1` before): one line naming
    the first row with another count; no output folder."""
    _write(ws / "b.jsonl", BENCH)
    _write(ws / "r.jsonl", json.dumps({"id": "0", "responses": ["\\boxed{0}"] * 4}) + "\n"
           + json.dumps({"id": "1", "responses": ["\\boxed{2}"]}) + "\n")
    one_line_error(emapg(ws, "eval", "--bench", "b.jsonl", "--responses", "r.jsonl", "--out", "o"), "r.jsonl:2", "same number")
    assert not (ws / "o").exists(), "an output folder was left behind"


@probe("eval_prompt_template_not_utf8")
def eval_prompt_template_not_utf8(ws: Path) -> None:
    """`eval --retriever ... --prompt-template latin1.txt`: one line naming the template as not UTF-8,
    before any model or index is loaded."""
    _write(ws / "b.jsonl", BENCH)
    _write(ws / "t.txt", b"Frage: {question} \xe9\xff")
    one_line_error(emapg(ws, "eval", "--bench", "b.jsonl", "--model", "no-such-model", "--retriever", "bm25:no-index",
                         "--prompt-template", "t.txt", "--out", "o"), "--prompt-template", "UTF-8")


@probe("huge_integer_ids")
def huge_integer_ids(ws: Path) -> None:
    """A 5000-digit integer id (past Python's 4300-digit int <-> str limit) in a bench row, a --responses row,
    a `prepare --from` JSONL and JSON file: one line naming the file (and line), exit 2, never an internal error."""
    row = '{"id": ' + HUGE_ID + ', "question": "What is 1+1?", "answers": ["2"]}'
    _write(ws / "big.jsonl", row + "\n")
    _write(ws / "big.json", "[" + row + "]")
    _write(ws / "b.jsonl", BENCH)
    _write(ws / "r.jsonl", '{"id": ' + HUGE_ID + ', "responses": ["2"]}\n')
    one_line_error(emapg(ws, "eval", "--bench", "big.jsonl", "--responses", "r.jsonl", "--out", "o1"), "big.jsonl:1", "digits")
    one_line_error(emapg(ws, "eval", "--bench", "b.jsonl", "--responses", "r.jsonl", "--out", "o2"), "r.jsonl:1", "digits")
    one_line_error(emapg(ws, "prepare", "mine", "--from", "big.jsonl", "--out", "p1"), "big.jsonl:1", "digits")
    one_line_error(emapg(ws, "prepare", "mine", "--from", "big.json", "--out", "p2"), "big.json", "digits")
    leftovers = [d for d in ("o1", "o2", "p1", "p2") if (ws / d).exists()]
    assert not leftovers, f"output folders left behind: {leftovers}"


# ------------------------------------------------------------------------------------------ issue 40

def _eval_folder(folder: Path, run: dict, correct: list[bool]) -> Path:
    folder.mkdir()
    _write(folder / "results.jsonl", "".join(json.dumps({"id": str(i), "correct": [c]}) + "\n" for i, c in enumerate(correct)))
    _write(folder / "run.json", json.dumps(run))
    return folder


@probe("compare_json_never_over_results")
def compare_json_never_over_results(ws: Path) -> None:
    """`eval --compare A B --json A/results.jsonl` replaced A's per-item results with the comparison record (issue 40,
    item 6): --json writes a new file or an earlier record, anything else is one line and stays as it was. And two
    evaluations made with different settings (32 samples at T 0.8 against greedy, item 9) are compared with one
    warning line naming them."""
    run = {"model": "m", "n": 1, "temperature": 0.0, "top_p": 1.0, "max_tokens": 64, "reward": "math"}
    a = _eval_folder(ws / "A", {**run, "n": 32, "temperature": 0.8}, [True, False, True, True])
    _eval_folder(ws / "B", run, [False, False, True, True])
    before = (a / "results.jsonl").read_bytes()
    one_line_error(emapg(ws, "eval", "--compare", "A", "B", "--json", "A/results.jsonl"), "not an earlier comparison record")
    assert (a / "results.jsonl").read_bytes() == before, "A/results.jsonl was written over"
    r = ok(emapg(ws, "eval", "--compare", "A", "B", "--json", "cmp.json"))
    warnings = [line for line in r.err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "n 32 vs 1" in warnings[0] and "temperature 0.8 vs 0.0" in warnings[0], r.show()


@probe("bench_generate_past_the_context")
def bench_generate_past_the_context(ws: Path) -> None:
    """`bench generate --max-new-tokens 65536` on a model of 1,024 positions ran past its context without a word
    (issue 40, item 7): one line naming the context."""
    code = "import sys; from emapg_cli.models.tiny import save_tiny; save_tiny(sys.argv[1], hidden=16, layers=1, heads=2, kv_heads=1)"
    subprocess.run([sys.executable, "-c", code, str(ws / "tiny")], check=True, cwd=ws, timeout=120, capture_output=True,
                   env=base_env(ws))
    _write(ws / "d.jsonl", "".join(json.dumps({"id": str(i), "question": f"{i}+1", "answers": [str(i + 1)]}) + "\n" for i in range(4)))
    one_line_error(emapg(ws, "bench", "generate", "--preset", "toy", "--set", "model.path=tiny", "--set", "data.train=d.jsonl",
                         "--set", "rollout.n=2", "--sequences", "2", "--max-new-tokens", "65536", "--threads", "1", timeout=120),
                   "past the model's context of 1024")
