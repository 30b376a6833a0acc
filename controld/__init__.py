# controld - installed as zz.controld: the per-host control daemon.
# Later: libvirt/process backends, WAKEUP/SHUTDOWN certificate checks, snapshot file server.
"""ZZ per-host control daemon: VM lifecycle, certificates and state serving (to come)."""
