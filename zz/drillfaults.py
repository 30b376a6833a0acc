"""zz/drillfaults.py - the faults a drill makes an execution runtime commit: the runtime's own
(--inject-fault, which controld checks for zz drill) and the fault file that a runtime started
with --drill-faults reads in its state directory (zz drill, the campaign; docs/execution.md)."""

from __future__ import annotations

# Test-only fault switches (tests/test_execution_faults.py); execution/drillfaults.py commits them.
FAULTS = ("diverge-state", "wrong-reply", "slow-report", "corrupt-snapshot")
FAULT_FILE = "zz-fault.json"  # read only with drill_faults (python -m zz.execution --drill-faults)
