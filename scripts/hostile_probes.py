"""Run the hostile-user probes (scripts/probes/) and print PASS/FAIL for each; exit 1 if any failed.

    python scripts/hostile_probes.py [--fast] [-k SUBSTRING] [--list]

Every probe runs in a fresh temporary folder with its own EMAPG_HOME, offline. `--fast` skips the
probes marked slow (tests/test_hostile_probes.py runs the fast ones in CI and the slow ones with -m slow).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from probes import load_all  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fast", action="store_true", help="skip the probes marked slow")
    ap.add_argument("-k", default="", help="run only probes whose id (area:name) contains this")
    ap.add_argument("--list", action="store_true", help="list the probes and what each checks, run nothing")
    args = ap.parse_args()
    probes = [p for p in load_all() if args.k in p.id and not (args.fast and p.slow)]
    if args.list:
        for p in probes:
            print(f"{p.id}{' [slow]' if p.slow else ''}: {p.doc}")
        return 0
    failed = 0
    for p in probes:
        ws = Path(tempfile.mkdtemp(prefix="emapg-probe-"))
        t0 = time.monotonic()
        try:
            p.fn(ws)
            verdict = "PASS"
        except AssertionError as e:
            verdict, failed = f"FAIL: {str(e).splitlines()[0] if str(e) else 'assertion'}", failed + 1
        except Exception as e:  # a broken probe is a failure too, never a pass
            verdict, failed = f"FAIL (probe error): {type(e).__name__}: {e}", failed + 1
            traceback.print_exc()
        finally:
            shutil.rmtree(ws, ignore_errors=True)
        print(f"{verdict[:4]} {p.id} ({time.monotonic() - t0:.1f} s){verdict[4:]}", flush=True)
    print(f"{len(probes) - failed}/{len(probes)} probes passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
