# tests/test_agreed_fd_exhaustion.py - zz-agreed out of file descriptors (issue 15 item 3):
# accept fails with EMFILE while the listener stays readable. The replica must back off
# (the listener leaves epoll for 100 ms .. 1 s), count it (stats net.accept_backoffs),
# keep serving its established connections, and accept again once descriptors are free;
# before the fix it spun on epoll_wait + accept at a full core.
from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import socket
import time
from pathlib import Path

from cluster import running_cluster

TICKS = os.sysconf("SC_CLK_TCK")
HEADROOM = 12  # descriptors left to the replica above what it holds when the limit drops
EXTRA = 64  # connections opened against it: far more than the headroom


def cpu_s(pid: int) -> float:
    """utime + stime of /proc/<pid>/stat, in seconds."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_accept_out_of_descriptors_backs_off(tmp_path: Path) -> None:
    socks: list[socket.socket] = []
    with running_cluster(tmp_path, clients=4) as c:
        try:
            pid = c.procs[0].pid
            c.wait_for(
                lambda: c.stats(0)["net"]["frames_in"] > 0, 10, "replica 0 hearing its peers"
            )
            _, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
            low = open_fds(pid) + HEADROOM
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (low, hard))
            addr = ("127.0.0.1", c.port(0))
            for _ in range(EXTRA):  # the ones over the limit wait in the listen backlog
                socks.append(socket.create_connection(addr, timeout=5))
            # Wait until the replica holds every descriptor it may: accept fails from then on.
            c.wait_for(lambda: open_fds(pid) >= low, 10, "replica 0 out of descriptors")
            time.sleep(0.3)
            t0 = cpu_s(pid)
            time.sleep(2.0)
            used = cpu_s(pid) - t0
            assert used < 0.5, f"zz-agreed used {used:.2f} s of CPU in 2 s out of descriptors"
            assert c.alive(0)
            # Free the descriptors (the limit stays low): the replica closes what the peers
            # closed, accepts again, and replica 0 itself executes a new request.
            for s in socks:
                s.close()
            socks.clear()
            c.wait_for(
                lambda: open_fds(pid) < low - HEADROOM // 2, 15, "replica 0 closing the extras"
            )
            net = c.stats(0)["net"]
            assert net.get("accept_backoffs", 0) > 0, net

            async def one() -> bytes:
                client = c.client(0)
                try:
                    return bytes(await client.invoke(b"after the shortage", timeout=20))
                finally:
                    with contextlib.suppress(Exception):
                        await client.close()

            before = c.stats(0)["last_exec"]
            assert asyncio.run(one())
            c.wait_for(lambda: c.stats(0)["last_exec"] > before, 15, "replica 0 executing")
        finally:
            for s in socks:
                s.close()
