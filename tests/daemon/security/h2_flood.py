"""Open raw HTTP/2 connections to gpusnapd's API socket, send many ListSnapshots calls and never read
(run as the hostile user; killed by the test).

    python h2_flood.py SOCKET CONNECTIONS STREAMS

Each connection advertises the largest flow-control windows HTTP/2 allows (so the server may send
everything at once), opens STREAMS calls of ``ListSnapshots`` (page size 1000), prints ``sent`` and then
sleeps, its socket unread: whatever the server answers stays queued in gpusnapd.
"""

from __future__ import annotations

import socket
import struct
import sys
import time

from gpusnap.daemon._proto import snapshots_pb2

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
MAX_WINDOW = 2**31 - 1
DATA, HEADERS, SETTINGS, WINDOW_UPDATE = 0, 1, 4, 8
END_STREAM, END_HEADERS, ACK = 1, 4, 1
SETTINGS_INITIAL_WINDOW_SIZE = 4


def frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def literal(name: bytes, value: bytes) -> bytes:
    """HPACK literal header field without indexing, new name, no Huffman (RFC 7541 6.2.2); short strings."""
    assert len(name) < 127 and len(value) < 127
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


def main() -> int:
    path, connections, streams = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    headers = b"".join(
        literal(k, v)
        for k, v in (
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", b"/gpusnap.v1.SnapshotService/ListSnapshots"),
            (b":authority", b"localhost"),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
        )
    )
    body = snapshots_pb2.ListSnapshotsRequest(page_size=1000).SerializeToString()
    message = b"\x00" + struct.pack(">I", len(body)) + body
    held = []
    for _ in range(connections):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        out = PREFACE + frame(SETTINGS, 0, 0, struct.pack(">HI", SETTINGS_INITIAL_WINDOW_SIZE, MAX_WINDOW))
        out += frame(SETTINGS, ACK, 0, b"") + frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", MAX_WINDOW - 65535))
        for i in range(streams):
            sid = 2 * i + 1
            out += frame(HEADERS, END_HEADERS, sid, headers) + frame(DATA, END_STREAM, sid, message)
        s.sendall(out)
        held.append(s)
    print("sent", flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    sys.exit(main())
