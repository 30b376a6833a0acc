# controld - installed as zz.controld: the per-host control daemon.
# The daemon (daemon.py, python -m zz.controld), its RPC, actions and inventory: docs/controld.md.
"""ZZ per-host control daemon: replica lifecycle driven by operator RPCs and certificates."""
