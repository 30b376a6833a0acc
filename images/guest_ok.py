# guest_ok.py - the guest's default command (images/init): a tiny TCP server on port 7000
# that answers every connection with "zz-guest ok\n" and closes it. The boot test
# (tests/test_images.py) reaches it through the slirp hostfwd 127.0.0.1:PORT -> guest:7000.
from __future__ import annotations

import socket
import sys

PORT = int(sys.argv[1]) if len(sys.argv) > 1 else 7000


def main() -> None:
    with open("/proc/uptime") as f:
        uptime = f.read().split()[0]
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", PORT))
    srv.listen(16)
    print(f"zz-guest: python {sys.version.split()[0]} up at {uptime} s, port {PORT}", flush=True)
    while True:
        conn, _ = srv.accept()
        with conn:
            try:
                conn.sendall(b"zz-guest ok\n")
            except OSError:
                pass


if __name__ == "__main__":
    main()
