"""Choosing torch's CPU threads (emapg_cli/train/threads.py)."""

import pytest


def test_auto_threads_leave_busy_cores_alone(monkeypatch):
    from emapg_cli.errors import UserError
    from emapg_cli.train.threads import ENV, auto_threads, choose_threads

    assert auto_threads(2, 1, 0.0) == 2  # idle 2-core machine: both
    assert auto_threads(2, 1, 0.3) == 2  # a background process using 30% of a core: round(1.7) = 2 free
    assert auto_threads(2, 1, 1.2) == 1  # another job keeps a core busy: round(0.8) = 1
    assert auto_threads(2, 1, 2.0) == 1  # both busy: at least 1
    assert auto_threads(16, 2, 4.0) == 6  # round(12) // 2 = 6 <= the share 16 // 2 = 8
    assert auto_threads(16, 2, 0.0) == 8  # capped at the share
    monkeypatch.setenv(ENV, "3")
    assert choose_threads(5) == (3, ENV)
    monkeypatch.delenv(ENV)
    assert choose_threads(5) == (5, "train.torch_threads")
    monkeypatch.setenv(ENV, "zero")
    with pytest.raises(UserError):
        choose_threads(None)


def _stat(*cores: tuple[int, int, int, int]) -> str:
    """A /proc/stat text with one `cpuN user nice system idle iowait irq softirq steal guest guest_nice` line per core
    from (user, system, idle, iowait), plus the aggregate line and lines that are not cores."""
    total = [sum(c[i] for c in cores) for i in range(4)]
    lines = [f"cpu  {total[0]} 0 {total[1]} {total[2]} {total[3]} 0 0 0 0 0"]
    lines += [f"cpu{i} {u} 0 {s} {idle} {io} 0 0 0 7 0" for i, (u, s, idle, io) in enumerate(cores)]
    return "\n".join(lines + ["intr 816938 0 0", "ctxt 123", "btime 1700000000", "procs_running 3", ""])


def test_busy_cores_from_two_readings():
    from emapg_cli.train.threads import busy_cores, cpu_times

    # cpu0: busy (user + system) 100 -> 180 ticks, total 200 -> 300: 80 of 100 ticks busy; the guest column (7) is
    # inside user already and is not counted twice
    assert cpu_times(_stat((60, 40, 100, 0)))[0] == (100, 200)
    before = _stat((60, 40, 100, 0), (10, 10, 500, 0), (0, 0, 100, 0))
    # cpu0 +70 user +10 system +20 idle: 80/100; cpu1 +0 busy, +60 idle +40 iowait: 0/100 (iowait is idle);
    # cpu2 did not tick: idle
    after = _stat((130, 50, 120, 0), (10, 10, 560, 40), (0, 0, 100, 0))
    assert busy_cores(before, after, {0, 1, 2}) == pytest.approx(0.8)
    assert busy_cores(before, after, {1, 2}) == 0.0  # another process's core is not ours to count (affinity)
    assert busy_cores(before, after, {0, 7}) == pytest.approx(0.8)  # a core /proc/stat does not list: idle


def _fake_machine(monkeypatch, readings, load=1.9):
    """/proc/stat answers `readings` in turn (an exception instance is raised), the 1-minute load average is
    `load`, the process may run on cores 0 and 1, and the sample's sleep is skipped."""
    from emapg_cli.train import threads

    answers = iter(readings)

    def read():
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.delenv(threads.ENV, raising=False)
    monkeypatch.setattr(threads, "read_proc_stat", read)
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(threads, "available_cores", lambda: {0, 1})
    monkeypatch.setattr(threads.time, "sleep", lambda s: None)


def test_idle_cores_now_not_the_load_average_of_the_last_minute(monkeypatch):
    # issue 32: right after `emapg prepare` the 1-minute load average is still ~1.9 on an idle 2-core machine, and
    # train chose 1 thread; the cores' idle time over the sample says both are free (busy 2 + 1 of 200 ticks)
    from emapg_cli.train.threads import choose_threads

    _fake_machine(monkeypatch, [_stat((0, 0, 0, 0), (0, 0, 0, 0)), _stat((2, 0, 98, 0), (0, 1, 99, 0))], load=1.9)
    assert choose_threads(None) == (2, "auto")
    # a job busy on one core now: 95 of 100 ticks on cpu1 -> round(2 - 0.97) = 1 thread, whatever the load average
    _fake_machine(monkeypatch, [_stat((0, 0, 0, 0), (0, 0, 0, 0)), _stat((2, 0, 98, 0), (95, 0, 5, 0))], load=0.0)
    assert choose_threads(None) == (1, "auto")
    # two local processes share the 2 free cores: 1 each
    _fake_machine(monkeypatch, [_stat((0, 0, 0, 0), (0, 0, 0, 0)), _stat((0, 0, 100, 0), (0, 0, 100, 0))])
    assert choose_threads(None, local_processes=2) == (1, "auto")


def test_without_proc_stat_the_load_average_and_the_note_says_so(monkeypatch):
    from emapg_cli.train.threads import choose_threads

    _fake_machine(monkeypatch, [FileNotFoundError("/proc/stat")], load=0.2)  # macOS
    assert choose_threads(None) == (2, "auto, load average")
    _fake_machine(monkeypatch, ["cpu0 1 2 x 4\n"] * 2, load=1.6)  # a /proc/stat this parser cannot read: round(0.4) -> 1
    assert choose_threads(None) == (1, "auto, load average")


def test_the_real_sample_is_short_and_in_range():
    import time

    from emapg_cli.train.threads import SAMPLE_SECONDS, available_cores, measure_busy

    cores = available_cores()
    start = time.perf_counter()
    busy, how = measure_busy(cores)
    assert SAMPLE_SECONDS <= time.perf_counter() - start < SAMPLE_SECONDS + 2  # a fraction of a second on a busy machine
    assert how == "idle cores" and 0.0 <= busy <= len(cores)
