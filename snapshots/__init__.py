# snapshots - installed as zz.snapshots: ZFS driver and verified checkpoint state.
# Later: zfs/zpool CLI wrapper, per-file SHA-256 manifests, on-demand verified fetch.
"""ZZ checkpoint snapshots: ZFS driver, file manifests and verified fetch (to come)."""
