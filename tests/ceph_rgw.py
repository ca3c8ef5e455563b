"""A real S3 server for tests and benchmarks: a throw-away single-node Ceph cluster (one monitor, one OSD
on memstore, radosgw) from Debian 12's packages, on loopback ports chosen free.

The recipe and its pitfalls are in docs/fleet.md ("The test gateway"); ``.ci/run`` installs the packages
(``radosgw ceph-mon ceph-osd``). Objects live in the OSD's RAM (memstore, 4 GiB device): keep test data
well under 1 GiB.
"""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from tests.starts import starts

ACCESS_KEY = "GPUSNAPTESTACCESSKEY"
SECRET_KEY = "gpusnap-test-secret-key-not-a-real-one"
REGION = "us-east-1"
BINARIES = ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "monmaptool", "ceph")


def available() -> str:
    """Empty when the Ceph binaries are installed, else what is missing."""
    missing = [b for b in BINARIES if shutil.which(b) is None]
    return f"Ceph binaries missing: {', '.join(missing)} (apt-get install radosgw ceph-mon ceph-osd)" if missing else ""


# Ports are drawn below Linux's ephemeral range (32768-60999 by default): a port the kernel hands out
# for bind(0) is also the local end of the next outgoing connection, and a monitor whose port was taken
# that way never binds, so every ``ceph`` command waits for it until its own timeout.
PORT_RANGE = (20000, 32767)
START_ATTEMPTS = 3


def _free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports that were free a moment ago (a start that loses one retries)."""
    ports: list[int] = []
    while len(ports) < n:
        port = random.randint(*PORT_RANGE)
        if port in ports:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
    return ports


@dataclasses.dataclass
class Gateway:
    """A running cluster; ``endpoint`` is the radosgw URL (path-style, region ``us-east-1``)."""

    root: Path
    conf: Path
    rgw_port: int
    procs: dict[str, subprocess.Popen[bytes]] = dataclasses.field(default_factory=dict)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.rgw_port}"

    def s3_client(self, max_pool_connections: int = 10) -> Any:
        """A boto3 S3 client of this gateway's test user (path-style; boto3's default pool of 10)."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            config=Config(s3={"addressing_style": "path"}, max_pool_connections=max_pool_connections),
        )

    def env(self) -> dict[str, str]:
        """Credentials through the SDK's usual environment variables."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": REGION}

    def _run(self, *args: str, timeout: float = 60) -> str:
        cmd = [args[0], "-c", str(self.conf), *args[1:]]
        if args[0] == "ceph":
            # Without it the CLI waits for an unreachable monitor for ever.
            cmd[3:3] = ["--connect-timeout", str(int(timeout))]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 10)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{' '.join(args)} timed out after {timeout + 10:.0f} s\n{self.logs()}") from None
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({res.returncode}): {res.stderr[-2000:]}\n{self.logs()}")
        return res.stdout

    def logs(self, chars: int = 1500) -> str:
        """The tail of each daemon's output and log, for a failure's message."""
        parts = []
        for name in sorted(self.procs):
            proc = self.procs[name]
            state = "running" if proc.poll() is None else f"exited {proc.returncode}"
            parts.append(f"--- {name} ({state}) ---")
            for path in (self.root / f"{name}.out", *sorted((self.root / "log").glob(f"*{name}*.log"))):
                if path.is_file():
                    parts.append(f"{path.name}: {path.read_text(errors='replace')[-chars:]}")
        return "\n".join(parts)

    def wait_mon(self, timeout: float = 30) -> None:
        """Wait until the monitor answers; raise at once if it exits (e.g. it could not bind its port)."""
        deadline = time.monotonic() + timeout
        while True:
            mon = self.procs["mon"]
            if mon.poll() is not None:
                raise RuntimeError(f"ceph-mon exited ({mon.returncode})\n{self.logs()}")
            try:
                self._run("ceph", "mon", "stat", timeout=3)
                return
            except RuntimeError:  # (not up yet)
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"ceph-mon did not answer in {timeout:.0f} s\n{self.logs()}")
            time.sleep(0.2)

    def _spawn(self, name: str, *args: str) -> None:
        log = open(self.root / f"{name}.out", "ab")
        # -f: stay in the foreground, so the process is ours to stop and never outlives the test session.
        self.procs[name] = subprocess.Popen(
            [args[0], "-f", "-c", str(self.conf), *args[1:]],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def start_rgw(self, timeout: float = 60) -> None:
        """Start (or restart) radosgw and wait until it answers HTTP."""
        self._spawn("rgw", "radosgw", "-n", "client.rgw")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.procs["rgw"].poll() is not None:
                raise RuntimeError(f"radosgw exited: {(self.root / 'rgw.out').read_text()[-2000:]}")
            try:
                urllib.request.urlopen(self.endpoint + "/", timeout=2).close()
                return
            except urllib.error.HTTPError:
                return  # it answers
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("radosgw did not answer in time")

    def stop_rgw(self) -> None:
        """Stop radosgw only (a gateway outage; the cluster keeps the data)."""
        proc = self.procs.pop("rgw", None)
        if proc is not None:
            _stop(proc)

    def stop(self) -> None:
        for name in ("rgw", "osd", "mon"):
            proc = self.procs.pop(name, None)
            if proc is not None:
                _stop(proc)
        shutil.rmtree(self.root, ignore_errors=True)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # a throw-away cluster
            proc.wait()


@starts("Ceph gateway")
def start(memstore_bytes: int = 4 << 30) -> Gateway:
    """Start a cluster under a fresh temporary directory and create the S3 user (``ACCESS_KEY``).

    A start that fails (a port taken between choosing it and binding it, a daemon slow on a loaded
    machine) is retried from scratch with new ports, ``START_ATTEMPTS`` times in all.

    Raises:
        RuntimeError: every attempt failed; the message has each attempt's cause and the daemons' output.
    """
    errors: list[str] = []
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            return _start_once(memstore_bytes)
        except RuntimeError as e:
            errors.append(f"attempt {attempt}: {e}")
    raise RuntimeError("the test Ceph cluster did not start:\n" + "\n".join(errors))


def _start_once(memstore_bytes: int) -> Gateway:
    root = Path(tempfile.mkdtemp(prefix="gpusnap-ceph-"))
    mon_port, rgw_port = _free_ports(2)
    fsid = str(uuid.uuid4())
    conf = root / "ceph.conf"
    conf.write_text(f"""[global]
fsid = {fsid}
mon host = [v2:127.0.0.1:{mon_port}]
public addr = 127.0.0.1
cluster addr = 127.0.0.1
ms bind ipv6 = false
auth cluster required = none
auth service required = none
auth client required = none
ms mon client mode = crc secure
paxos propose interval = 0.01
mon data avail warn = 1
mon data avail crit = 0
mon warn on insecure global id reclaim allowed = false
run dir = {root}/run
admin socket = {root}/run/$name.asok
pid file = {root}/run/$name.pid
log file = {root}/log/$name.log
mon cluster log file = {root}/log/cluster.log
crash dir = {root}/crash
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
mon allow pool size one = true
mon warn on pool no redundancy = false
mon max pg per osd = 1000
osd crush chooseleaf type = 0
[mon]
mon data = {root}/mon.$id
[osd]
osd data = {root}/osd.$id
osd objectstore = memstore
memstore device bytes = {memstore_bytes}
[client.rgw]
rgw data = {root}/rgw
rgw gc obj min wait = 1
rgw gc processor period = 5
rgw frontends = beast endpoint=127.0.0.1:{rgw_port}
""")
    for d in ("run", "log", "crash", "rgw"):
        (root / d).mkdir()
    gw = Gateway(root=root, conf=conf, rgw_port=rgw_port)
    try:
        subprocess.run(
            [
                "monmaptool",
                "--create",
                "--fsid",
                fsid,
                "--addv",
                "a",
                f"[v2:127.0.0.1:{mon_port}]",
                str(root / "monmap"),
            ],
            check=True,
            capture_output=True,
            timeout=30,
        )
        gw._run("ceph-mon", "--mkfs", "-i", "a", "--monmap", str(root / "monmap"))
        gw._spawn("mon", "ceph-mon", "-i", "a")
        gw.wait_mon()
        osd_uuid = str(uuid.uuid4())
        osd_id = gw._run("ceph", "osd", "new", osd_uuid).strip()
        (root / f"osd.{osd_id}").mkdir()
        gw._run("ceph-osd", "-i", osd_id, "--mkfs", "--osd-uuid", osd_uuid)
        gw._spawn("osd", "ceph-osd", "-i", osd_id)
        gw.start_rgw()
        gw._run(
            "radosgw-admin",
            "user",
            "create",
            "--uid=gpusnap-test",
            "--display-name=gpusnap test",
            f"--access-key={ACCESS_KEY}",
            f"--secret-key={SECRET_KEY}",
        )
    except BaseException:
        gw.stop()
        raise
    return gw
