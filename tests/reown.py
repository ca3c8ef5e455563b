"""Re-own a snapshot that root took: make it look as if an unprivileged user had dumped their own tree.

Root lacks CAP_SYS_RESOURCE on the test machines, so CRIU cannot dump another user's process here
(tests/daemon/test_access.py). Tests of non-root snapshots therefore dump a root process and then
rewrite, with pycriu, every task's credentials in the images (uids, gids, groups, and no capabilities
but the bounding set), the recorded owner of every unix socket's file and of every deleted file (what
the user's own dump records: the user bound or wrote them), set the manifest's owner, source uid/gid and owner credentials, and recompute
the manifest's image digests. Run it while no daemon serves the store (a daemon may cache manifests).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tests.conftest import criu_prefix
from tests.users import User


def _pycriu():  # type: ignore[no-untyped-def]
    path = str(criu_prefix() / "python")
    if path not in sys.path:
        sys.path.append(path)
    import pycriu

    return pycriu


def reown(snapshot_dir: Path, user: User) -> None:
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

    manifest = snapshot_dir / "manifest.json"
    doc = json.loads(manifest.read_text())
    doc["owner_uid"] = user.uid
    doc["source"]["uid"], doc["source"]["gid"] = user.uid, user.gid
    doc["owner_creds"] = {"uid": user.uid, "gid": user.gid, "groups": groups}
    doc["files"] = [{"path": f.path, "size_bytes": f.size_bytes, "sha256": f.sha256} for f in image_files(images)]
    manifest.write_text(json.dumps(doc, indent=2, sort_keys=True))
