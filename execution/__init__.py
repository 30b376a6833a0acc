# execution - installed as zz.execution: the execution-replica runtime (guest VM or process),
# the app interface, the bundled apps, commit certificates, reply cache and recovery.
"""ZZ execution replicas: runtime, application interface and bundled applications.

runtime.py is one replica (docs/execution.md, docs/design.md §3.3-§5.5), which owns its
checkpoints (checkpointing.py: taking them, EXEC-CHECKPOINT, stability, collection, restart)
and the seam of its test-only faults (drillfaults.py, with byzantine.py the campaign's
behaviours; drills only); app.py, state.py and registry.py the app interface, apps/ the
bundled apps (kv, microbench, the WSGI adapter with the guestbook; docs/apps.md);
certificates.py commit certificates; replycache.py exactly-once; recovery.py catching up
from peers' snapshots (docs/recovery.md). Checkpoint manifests and stores are zz.snapshots.
"""
