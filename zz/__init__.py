# zz - the ZZ BFT hosting control plane: wire codec, keys, rack config, client and CLI.
# Sub-packages execution, controld and snapshots live in top-level directories (pyproject).
"""ZZ: a Byzantine-fault-tolerant hosting control plane."""

__version__ = "0.1.0"
