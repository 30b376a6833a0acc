# zz/drill/ - `zz drill KIND CONFIG`: fault injection against a rack that is up (zz rack up),
# under recorded KV load; watches the replicas and controlds, writes the report (zz/report.py).
"""Fault-injection drills (docs/operations.md, "Drills").

One drill = KV clients recording a history (zz/history.py) on the kv services of a running
rack, `--before` seconds of load, the fault, `--after` seconds of watching, then the
verdicts. Observed on one monotonic clock, every 100 ms:

* agreement replicas' stats files (view, view change, every counter: exec_mismatches,
  exec_timeouts, and whatever fault detection adds), the first change after the fault
  of any counter is a detection event;
* every controld's `status` (CONTROL RPC as operator 0): counters `wakeup_accepted`,
  `woken`, `shutdown_accepted`, `convicted`, `reprovisioned`, and its `recent` lines,
  which name the replicas woken, convicted and provisioned.

Nothing is inferred that was not observed: a drill whose fault pipeline (detection in
zz-agreed, WAKEUP/SHUTDOWN to controld, recovery) did not act says FAIL and names the
missing step; a kind that cannot be injected into this rack refuses before starting.

The package, one concern a module:

* runner.py  - Drill: the phases every kind shares, the report, the restore; run(), the CLI
* kind.py    - DrillKind: what a kind needs, injects, must see, reports, and whether it convicts
* kinds.py   - the registry, name -> class (argparse's choices come from it)
* client_faults.py - primary, client-flood, slow-reader, mac-split, big-request, half-frames
* exec_faults.py   - wrong-reply, crash, slow, corrupt-snapshot, byzantine-host
* observe.py - Observer (stats files, controlds) and the rules read from it
* load.py    - the honest kv or HTTP load
* rack.py    - the rack that is up, and what a drill does to its processes and runtimes
"""

from __future__ import annotations

from zz.drill.kind import DrillKind
from zz.drill.kinds import KINDS
from zz.drill.load import Load, start_load, stop_load
from zz.drill.observe import Observer, awaiting_spares, open_rounds, waiting_faults
from zz.drill.rack import DrillError
from zz.drill.runner import Drill, Progress, add_arguments, main_cli, need_lincheck, run

__all__ = [
    "KINDS",
    "Drill",
    "DrillError",
    "DrillKind",
    "Load",
    "Observer",
    "Progress",
    "add_arguments",
    "awaiting_spares",
    "waiting_faults",
    "main_cli",
    "need_lincheck",
    "open_rounds",
    "run",
    "start_load",
    "stop_load",
]
