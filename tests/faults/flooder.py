"""Floods UDP ports with garbage as fast as one Python process can: `flooder.py SECONDS PORT [PORT ...]`.
Prints `flooder: <datagrams> datagrams in <seconds> s` at the end. Used by tests/faults/test_flood.py."""

import os
import socket
import sys
import time

seconds, ports = float(sys.argv[1]), [int(p) for p in sys.argv[2:]]
payloads = [os.urandom(n) for n in (40, 64, 200, 512, 1400)]  # shorter than, as long as, and longer than a heartbeat
payloads.append(b"\x00" * 8 + os.urandom(200))  # a job tag of zeros
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
targets = [("127.0.0.1", p) for p in ports]
sent, start = 0, time.monotonic()
deadline = start + seconds
while time.monotonic() < deadline:
    for payload in payloads:
        for target in targets:
            try:
                sock.sendto(payload, target)
                sent += 1
            except OSError:  # a rank gone: its port refuses
                pass
print(f"flooder: {sent} datagrams in {time.monotonic() - start:.1f} s", flush=True)
