"""A file that sends data out (issue 28) by every kind of socket it can open: UDP, TCP, MPTCP
(which a TCP-only rule misses), pathname and abstract unix sockets, netlink, raw packets.

CHECK_ATTENTION_ESCAPE_TARGETS, when set by a test, names a UDP port, a TCP port and a unix
socket path on this machine that listen for it. Each socket it could open, and each target it
reached, is named in the error raised at import. Otherwise `Layer` is a correct layer.

Test material for tests/test_sandbox.py; not part of the package.
"""
import os
import socket

from fused import CausalSelfAttention as Layer  # noqa: F401

udp, tcp, path = (os.environ.get("CHECK_ATTENTION_ESCAPE_TARGETS", "") or "0 0 -").split(" ", 2)
KINDS = [("UDP", socket.AF_INET, socket.SOCK_DGRAM, 0, ("127.0.0.1", int(udp))),
         ("UDP6", socket.AF_INET6, socket.SOCK_DGRAM, 0, None),
         ("TCP", socket.AF_INET, socket.SOCK_STREAM, 0, ("127.0.0.1", int(tcp))),
         ("MPTCP", socket.AF_INET, socket.SOCK_STREAM, 262, ("127.0.0.1", int(tcp))),
         ("unix", socket.AF_UNIX, socket.SOCK_STREAM, 0, path),
         ("abstract unix", socket.AF_UNIX, socket.SOCK_DGRAM, 0, "\0check-attention"),
         ("netlink", socket.AF_NETLINK, socket.SOCK_RAW, 0, None),
         ("packet", socket.AF_PACKET, socket.SOCK_DGRAM, 0, None)]
worked = []
for name, family, kind, proto, address in KINDS:
    try:
        s = socket.socket(family, kind, proto)
    except OSError:
        continue
    worked.append(f"opened a {name} socket")
    try:
        s.settimeout(1)
        if address not in (None, "-") and address[-1] != 0:
            s.connect(address)
            s.send(b"escaped")
            worked.append(f"reached {address} by {name}")
    except OSError:
        pass
    finally:
        s.close()
if worked:
    raise RuntimeError("escaped: " + "; ".join(worked))
