"""Re-own a snapshot that root took: make it look as if an unprivileged user had dumped their own tree.

Root lacks CAP_SYS_RESOURCE on the test machines, so CRIU cannot dump another user's process here
(tests/daemon/test_access.py). Tests of non-root snapshots therefore dump a root process and then
rewrite, with pycriu, every task's credentials in the images (uids, gids, groups, and no capabilities
but the bounding set), the recorded owner of every unix socket's file and of every deleted file (what
the user's own dump records: the user bound or wrote them), set the manifest's owner, source uid/gid, owner
and process credentials, and recompute
the manifest's image digests. Run it while no daemon serves the store (a daemon may cache manifests).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tests.conftest import WORKLOADS, criu_prefix, start_daemon, stop_daemon, wait_for
from tests.users import User


def _pycriu():  # type: ignore[no-untyped-def]
    path = str(criu_prefix() / "python")
    if path not in sys.path:
        sys.path.append(path)
    import pycriu
    import pycriu.images  # (by name: the CRIU helper's loader, run in-process by driver tests, skips pycriu's __init__)

    return pycriu


def reown(snapshot_dir: Path, user: User, *, owner: bool = True, tree_creds: bool = True) -> None:
    """Make the snapshot's tree ``user``'s. ``owner``: the snapshot is the user's too (as the user's own dump
    records it); else it stays root's (root's dump of the user's tree). ``tree_creds``: the manifest records
    every process's rights (as this gpusnap's dumps do); else it lacks them (as older gpusnap's did)."""
    pycriu = _pycriu()
    images = snapshot_dir / "images"
    groups = sorted(set(os.getgrouplist(user.name, user.gid)))
    for core in sorted(images.glob("core-*.img")):
        with open(core, "rb") as fh:
            img = pycriu.images.load(fh)
        for entry in img["entries"]:
            creds = entry["thread_core"]["creds"]
            for key in ("uid", "euid", "suid", "fsuid"):
                creds[key] = user.uid
            for key in ("gid", "egid", "sgid", "fsgid"):
                creds[key] = user.gid
            creds["groups"] = groups
            for key in ("cap_inh", "cap_prm", "cap_eff", "cap_amb"):
                if key in creds:
                    creds[key] = [0] * len(creds[key])
        with open(core, "wb") as fh:
            pycriu.images.dump(img, fh)
    for ghost in sorted(images.glob("ghost-file-*.img")):  # deleted files: the user's own
        with open(ghost, "rb") as fh:
            data = fh.read()
        # The entry (after two magics and its size) is followed by the file's bytes, which pycriu's
        # dump would not write back: re-encode the entry alone and keep the rest as it was.
        from pycriu.images import ghost_file_pb2  # type: ignore[import-not-found]

        size = int.from_bytes(data[8:12], "little")
        entry = ghost_file_pb2.ghost_file_entry()
        entry.ParseFromString(data[12 : 12 + size])
        entry.uid, entry.gid = user.uid, user.gid
        blob = entry.SerializeToString()
        with open(ghost, "wb") as fh:
            fh.write(data[:8] + len(blob).to_bytes(4, "little") + blob + data[12 + size :])
    files = images / "files.img"
    with open(files, "rb") as fh:
        img = pycriu.images.load(fh)
    for entry in img["entries"]:
        perms = entry.get("usk", {}).get("file_perms")
        if perms:
            perms["uid"], perms["gid"] = user.uid, user.gid
    with open(files, "wb") as fh:
        pycriu.images.dump(img, fh)
    from gpusnap.daemon.store.checksum import image_files
    from tests.lanes import LANES

    manifest = snapshot_dir / "manifest.json"
    doc = json.loads(manifest.read_text())
    if owner:
        doc["owner_uid"] = user.uid
    doc["source"]["uid"], doc["source"]["gid"] = user.uid, user.gid
    doc["owner_creds"] = {"uid": user.uid, "gid": user.gid, "groups": groups}
    if tree_creds:
        doc["tree_creds"] = [
            {"pid": pid, "uid": user.uid, "gid": user.gid, "groups": groups} for pid in doc["source"]["tree_pids"]
        ]
    else:
        doc.pop("tree_creds", None)
    doc["files"] = [
        {"path": f.path, "size_bytes": f.size_bytes, "sha256": f.sha256} for f in image_files(images, LANES.digest)
    ]
    manifest.write_text(json.dumps(doc, indent=2, sort_keys=True))


SYSTEM_PYTHON = "/usr/bin/python3"
"""Workloads for re-owning run on a Python every user may open (this test's may live under root's home)."""


def dumped_by_root(tmp: Path, name: str, ready: Path, script: str, *args: str, cwd: str = "/") -> Path:
    """Run workload ``script`` as root until it writes ``ready``, dump it as ``name`` with a daemon on a
    store under ``tmp`` (stopped again), and return the snapshot's directory, for :func:`reown`. ``cwd``: where it
    runs (``/`` unless the workload's files are relative)."""
    holder = subprocess.Popen(
        [SYSTEM_PYTHON, str(WORKLOADS / script), *args],
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_for(lambda: ready.exists(), 30, f"{script} did not start")
        d = start_daemon(tmp / "d1")
        try:
            snap = json.loads(d.cli("-o", "json", "dump", str(holder.pid), "--name", name, check=True).stdout)
        finally:
            stop_daemon(d)
        holder.wait(timeout=10)
    finally:
        if holder.poll() is None:
            holder.kill()
    return d.store / "snapshots" / snap["id"]


@contextlib.contextmanager
def user_home(user: User, prefix: str) -> Iterator[Path]:
    """A home directory of ``user``'s in a fresh directory every user may traverse (this test's temporary
    directory may not be), removed with everything in it afterwards."""
    base = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        os.chmod(base, 0o755)
        home = base / "home"
        home.mkdir()
        os.chown(home, user.uid, user.gid)
        yield home
    finally:
        subprocess.run(["rm", "-rf", str(base)])
