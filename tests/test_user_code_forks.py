"""`bounds.user_code()`: nothing user code forks outlives the process that ran it (docs/reliability.md, "User code is
contained"). The race this pins: a forked copy that forks again and returns at once exits (`os._exit` in
`user_code()`) before its own child has asked for SIGKILL on its parent's death; that grandchild was then orphaned
and lived on holding the inherited stdout (CI once waited 240 s on `emapg eval --env fork.py:Env`; 98 of 200
grandchildren survived a run of the script below before the fix)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")

#: The probe's FORKING pattern, `calls` times in a row: per call one copy returns into emapg's code (it must exit
#: there) and two copies (one per branch) sleep, holding stdout.
SCRIPT = """
import os, sys, time
from emapg_cli.bounds import user_code

def _fork():
    if os.fork() == 0:
        pass
    if os.fork() == 0:
        time.sleep(120)

for _ in range(int(sys.argv[1])):
    with user_code():
        _fork()
print("done", flush=True)
"""


def test_no_forked_copy_holds_stdout_after_the_caller_exits():
    p = subprocess.Popen([sys.executable, "-c", SCRIPT, "100"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=30)  # EOF on both pipes: every process holding them has exited
    except subprocess.TimeoutExpired:
        pytest.fail("a process forked inside user_code() still holds stdout 30 s on (it sleeps 120 s)")
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # the session, whatever is left of it
        except ProcessLookupError:
            pass
    assert p.returncode == 0, err
    assert out.split() == ["done"], f"a forked copy ran the caller's code on: {out!r}"
