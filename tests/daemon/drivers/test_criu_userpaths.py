"""criu_userpaths.plan on hand-made images: which socket entries the owner makes, what CRIU is left with,
and what is refused (the end-to-end attacks are tests/daemon/security/test_restore_paths.py)."""

from __future__ import annotations

import socket
import struct
import sys
from typing import Any

import pytest

from gpusnap.daemon.drivers import criu_images, criu_userpaths
from gpusnap.daemon.drivers.criu_userpaths import USK_EXTERN, Refused, plan
from tests.conftest import criu_prefix, needs_pycriu

if str(criu_prefix() / "python") not in sys.path:
    sys.path.append(str(criu_prefix() / "python"))

pytestmark = needs_pycriu

ESTABLISHED, CLOSE, LISTEN = 1, 7, 10


def _image(*entries: Any) -> bytes:
    out = struct.pack("<II", criu_images.IMG_COMMON_MAGICS[0], 0x5643A438)
    for e in entries:
        blob = e.SerializeToString()
        out += struct.pack("<I", len(blob)) + blob
    return out


def _usk(fid: int, ino: int, *, name: bytes = b"", state: int = LISTEN, peer: int = 0, kind: int = 1) -> Any:
    fdinfo_pb2 = criu_userpaths._pb()[0]
    fe = fdinfo_pb2.file_entry(type=fdinfo_pb2.UNIXSK, id=fid)
    u = fe.usk
    u.id, u.ino, u.type, u.state, u.flags, u.uflags, u.backlog, u.peer = fid, ino, kind, state, 0, 0, 4, peer
    u.fown.uid = u.fown.euid = u.fown.signum = u.fown.pid_type = u.fown.pid = 0
    u.opts.so_sndbuf = u.opts.so_rcvbuf = 4096
    u.opts.so_snd_tmo_sec = u.opts.so_snd_tmo_usec = u.opts.so_rcv_tmo_sec = u.opts.so_rcv_tmo_usec = 0
    u.name = name + b"\0" if name else b""
    if name:
        u.file_perms.mode, u.file_perms.uid, u.file_perms.gid = 0o140755, 1000, 1000
    return fe


def _entries(data: bytes) -> list[Any]:
    return criu_userpaths._records(data, criu_userpaths._pb()[0].file_entry)


def test_a_listener_is_the_owners_and_its_accepted_connection_loses_the_name() -> None:
    files = _image(
        _usk(1, 100, name=b"/home/u/s/api.sock"),
        _usk(2, 101, name=b"/home/u/s/api.sock", state=ESTABLISHED, peer=102),  # accepted
        _usk(3, 102, state=ESTABLISHED, peer=101),  # the client
    )
    planned = plan(files, [], set(), "/scratch")
    assert planned is not None
    ops, rewritten = planned
    assert [(o.entry.ino, o.bind, o.listen, o.mode) for o in ops] == [(100, b"/home/u/s/api.sock", 4, 0o755)]
    listener, accepted, client = (fe.usk for fe in _entries(rewritten))
    assert listener.uflags & USK_EXTERN and listener.name == b"/home/u/s/api.sock\0"
    assert accepted.name == b"" and not accepted.HasField("file_perms")
    assert client.name == b""


def test_nothing_to_change_without_paths() -> None:
    assert plan(_image(_usk(1, 100, name=b"\0abstract"), _usk(2, 101, state=CLOSE)), [], set(), "/s") is None


def test_a_connection_by_name_is_made_by_the_owner_after_the_binds() -> None:
    dgram = socket.SOCK_DGRAM
    files = _image(
        _usk(1, 100, name=b"/home/u/s/in", state=CLOSE, kind=dgram),  # a bound datagram receiver
        _usk(2, 101, state=ESTABLISHED, peer=100, kind=dgram),  # connected to it by name
    )
    planned = plan(files, [], set(), "/scratch")
    assert planned is not None
    assert [(o.bind, o.connect) for o in planned[0]] == [(b"/home/u/s/in", b""), (b"", b"/home/u/s/in")]


def test_queued_data_and_bound_pairs_are_refused() -> None:
    files = _image(_usk(1, 100, name=b"/home/u/s/api.sock"))
    with pytest.raises(Refused, match="holds queued data") as e:
        plan(files, [], {1}, "/scratch")
    assert e.value.reason == "UNIX_SOCKET_UNRESTORABLE"
    dgram = socket.SOCK_DGRAM
    pair = _image(
        _usk(1, 100, name=b"/home/u/a", state=ESTABLISHED, peer=101, kind=dgram),
        _usk(2, 101, name=b"/home/u/b", state=ESTABLISHED, peer=100, kind=dgram),
    )
    with pytest.raises(Refused, match="as a pair"):
        plan(pair, [], set(), "/scratch")


def test_ghosts_move_to_the_scratch_directory_and_link_remaps_outside_dev_shm_are_refused() -> None:
    fdinfo_pb2, _, remap_pb2 = criu_userpaths._pb()

    def reg(fid: int, name: str) -> Any:
        fe = fdinfo_pb2.file_entry(type=fdinfo_pb2.REG, id=fid)
        fe.reg.id, fe.reg.flags, fe.reg.pos, fe.reg.name = fid, 0, 0, name
        fe.reg.fown.uid = fe.reg.fown.euid = fe.reg.fown.signum = fe.reg.fown.pid_type = fe.reg.fown.pid = 0
        return fe

    ghost = remap_pb2.remap_file_path_entry(orig_id=7, remap_id=1, remap_type=criu_userpaths.GHOST)
    planned = plan(_image(reg(7, "/home/u/d/x"), reg(8, "/usr/lib/libc.so")), [ghost], set(), "/scratch")
    assert planned is not None
    assert [fe.reg.name for fe in _entries(planned[1])] == ["/scratch/ghosts/7-x", "/usr/lib/libc.so"]
    linked = remap_pb2.remap_file_path_entry(orig_id=7, remap_id=9, remap_type=criu_userpaths.LINKED)
    shm = _image(reg(7, "/dev/shm/sem.x"), reg(9, "/dev/shm/link_remap.9"))
    assert plan(shm, [linked], set(), "/scratch") is None
    home = _image(reg(7, "/home/u/d/x"), reg(9, "/home/u/d/link_remap.9"))
    with pytest.raises(Refused, match="link_remap.9") as e:
        plan(home, [linked], set(), "/scratch")
    assert e.value.reason == "LINK_REMAP_UNSAFE"
