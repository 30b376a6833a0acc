# controld/ledger.py - the operators' CONTROL request ids controld has accepted, persisted
# next to the inventory so a replayed or reused request id is refused after a restart too.
"""Persisted request ids of one controld (an anti-replay window per operator).

Per operator: `floor` and `recent`, the ids accepted above the floor (at most WINDOW). An
id is accepted once: refused if it is at or below the floor or already in `recent`. When
`recent` grows past WINDOW its smallest id becomes the floor. So concurrent requests of
one operator (the `zz` CLI uses time.time_ns(); `zz drill` polls several controlds at
once) may arrive out of order, while a replay - of any id ever accepted - is refused
without keeping every id. The id is recorded before the request runs: a request is never
run twice, even across a crash.

The WAKEUP/SHUTDOWN replay guard is zz.certs.Freshness, persisted by the daemon in the
same directory (freshness.json).
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from pathlib import Path

from zz.atomicfile import write_atomic

FORMAT = "zz-controld-ledger/2"
WINDOW = 256


@dataclass
class _Window:
    floor: int = -1
    recent: list[int] = field(default_factory=list)  # ascending, all > floor


class Ledger:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.operators: dict[int, _Window] = {}
        if self.path.exists():
            data = json.loads(self.path.read_text())
            if data.get("format") != FORMAT:
                raise ValueError(f"{self.path}: format {data.get('format')!r}, want {FORMAT}")
            for k, w in data["operators"].items():
                recent = sorted(int(x) for x in w["recent"])
                self.operators[int(k)] = _Window(int(w["floor"]), recent)

    def _persist(self) -> None:
        data = {
            "format": FORMAT,
            "operators": {
                str(k): {"floor": w.floor, "recent": w.recent}
                for k, w in sorted(self.operators.items())
            },
        }
        write_atomic(self.path, json.dumps(data) + "\n", durable=True)

    def accept_request(self, operator: int, request_id: int) -> bool:
        """Record `request_id` as used; False (nothing recorded) if it is not fresh."""
        w = self.operators.setdefault(operator, _Window())
        i = bisect.bisect_left(w.recent, request_id)
        if request_id <= w.floor or (i < len(w.recent) and w.recent[i] == request_id):
            return False
        w.recent.insert(i, request_id)
        if len(w.recent) > WINDOW:
            w.floor = w.recent.pop(0)
        self._persist()
        return True
