# execution - installed as zz.execution: the execution-replica runtime (guest VM or process).
# Later: the app interface, bundled apps (echo, WSGI adapter), checkpoint manifests, replies.
"""ZZ execution replicas: runtime, application interface and bundled applications (to come)."""
