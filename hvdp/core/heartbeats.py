"""The watchdog's wire: its UDP socket, the kernel filter that drops strangers' datagrams, and the heartbeat
packet (an 8-byte job tag, an HMAC-SHA256 tag, the body), apart from the logic of hvdp.core.watchdog.

A datagram whose first JOB_TAG_SIZE bytes are not the job's tag never reaches the process: drop_strangers()
attaches a classic BPF filter (SO_ATTACH_FILTER, Linux) that drops it in the kernel, so strangers neither wake
the watchdog's thread nor take room in the socket's receive buffer. Stdlib only.
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import socket
import struct

TAG_SIZE = 32  # HMAC-SHA256 digest
JOB_TAG_SIZE = 8  # the job's tag, checked before any cryptography
MAX_PACKET = 4096
RECEIVE_BUFFER = 4 << 20  # bytes asked for; the kernel caps it at net.core.rmem_max (x2)


def open_socket(bind: str = "0.0.0.0") -> socket.socket:
    """A UDP socket bound to address `bind` on a free port, for a Watchdog, with a receive buffer of up to
    RECEIVE_BUFFER bytes. Its family follows the address: IPv6 for an IPv6 address; "::" means every
    interface of both families (IPv4 peers then reach it as ::ffff:a.b.c.d).

    Args:
        bind: the address; default "0.0.0.0" (every IPv4 interface).

    Raises:
        OSError: `bind` is not an address of this host, or its family is not available.
    """
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0 if bind == "::" else 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
        sock.bind((bind, 0))
    except BaseException:
        sock.close()
        raise
    return sock


def drop_strangers(sock: socket.socket, tag: bytes) -> bool:
    """Attach a classic BPF filter to the UDP socket `sock` that drops, in the kernel, every datagram whose
    payload does not start with the JOB_TAG_SIZE bytes `tag`. Returns whether it could (False where the
    system has no SO_ATTACH_FILTER: then the watchdog's thread checks the tag itself).

    A socket filter sees the datagram from its UDP header (8 bytes), IPv4 and IPv6 alike.
    """
    first, second = struct.unpack("!II", tag)
    ld, jeq, ret = 0x20, 0x15, 0x06  # BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K, BPF_RET|BPF_K
    program = [(ld, 0, 0, 8), (jeq, 0, 3, first), (ld, 0, 0, 12), (jeq, 0, 1, second),
               (ret, 0, 0, 0xFFFFFFFF), (ret, 0, 0, 0)]  # whole datagram / nothing
    code = ctypes.create_string_buffer(b"".join(struct.pack("=HBBI", *i) for i in program))
    try:
        sock.setsockopt(socket.SOL_SOCKET, getattr(socket, "SO_ATTACH_FILTER", 26),
                        struct.pack("@HP", len(program), ctypes.addressof(code)))  # struct sock_fprog
    except OSError:
        return False
    return True


def plain_address(host: str) -> str:
    """The address `host` as a peer list names it: without an IPv6 scope ("%eth0") or the ::ffff: of an
    IPv4 peer seen on a dual-stack socket."""
    host = host.split("%", 1)[0]
    return host[7:] if host.startswith("::ffff:") and "." in host else host


def job_tag(secret: bytes) -> bytes:
    """The JOB_TAG_SIZE bytes every heartbeat of the job keyed by `secret` starts with: a packet without them
    is dropped before any cryptography. Derived from the secret, so only the job's ranks know it."""
    return hmac.new(secret, b"hvdp watchdog job tag", hashlib.sha256).digest()[:JOB_TAG_SIZE]


def seal(secret: bytes, body: bytes, tag: bytes | None = None) -> bytes:
    """A heartbeat as sent: the job's tag (`tag`, else job_tag(secret)), the HMAC-SHA256 of `body` under
    `secret`, then `body`."""
    return (tag or job_tag(secret)) + hmac.new(secret, body, hashlib.sha256).digest() + body


def heartbeat_targets(peers: list[list[tuple[str, int]]], rank: int, family: int) -> list[tuple[str, int]]:
    """Where the heartbeats of rank `rank` go: every address in `peers` (each rank's (host, port) list) of
    every other rank that a socket of `family` can reach (an IPv4 address as ::ffff:a.b.c.d from an IPv6
    socket; an IPv6 one not from an IPv4 socket)."""
    targets = []
    for r, addresses in enumerate(peers):
        for host, port in (addresses if r != rank else []):
            if ":" not in host:
                targets.append((host, port) if family == socket.AF_INET else ("::ffff:" + host, port))
            elif family == socket.AF_INET6:
                targets.append((host, port))
    return targets


__all__ = ["TAG_SIZE", "JOB_TAG_SIZE", "MAX_PACKET", "RECEIVE_BUFFER", "open_socket", "drop_strangers", "plain_address",
           "job_tag", "seal", "heartbeat_targets"]
