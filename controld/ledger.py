# controld/ledger.py - the operators' CONTROL request ids controld has accepted, persisted
# next to the inventory so a replayed or reused request id is refused after a restart too.
"""Persisted request ids of one controld.

operators: principal -> the highest CONTROL request id accepted. Ids must increase
strictly per operator (the `zz` CLI uses time.time_ns()), so a reused id - a replay or a
second use - is rejected without keeping every id ever seen. The id is recorded before
the request runs: a request is never run twice, even across a crash.

The WAKEUP/SHUTDOWN replay guard is zz.certs.Freshness, persisted by the daemon in the
same directory (freshness.json).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

FORMAT = "zz-controld-ledger/1"


class Ledger:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.operators: dict[int, int] = {}
        if self.path.exists():
            data = json.loads(self.path.read_text())
            if data.get("format") != FORMAT:
                raise ValueError(f"{self.path}: format {data.get('format')!r}, want {FORMAT}")
            self.operators = {int(k): int(v) for k, v in data["operators"].items()}

    def _persist(self) -> None:
        data = {"format": FORMAT, "operators": {str(k): v for k, v in self.operators.items()}}
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w") as fh:
            json.dump(data, fh, indent=1)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)

    def accept_request(self, operator: int, request_id: int) -> bool:
        """Record `request_id` as used; False (nothing recorded) if it is not fresh."""
        if request_id <= self.operators.get(operator, -1):
            return False
        self.operators[operator] = request_id
        self._persist()
        return True
