"""The systemd packaging: systemd/gpusnapd.service, the sysusers/tmpfiles snippets, the example
config and scripts/install-service.sh.

Tools that are not installed (systemd-analyze, systemd-sysusers, systemd-tmpfiles: Debian package
``systemd``; ``shellcheck``) make the tests that need them skip with a reason.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import stat
import subprocess
import tomllib
from pathlib import Path

import pytest

from gpusnap.daemon.config import DaemonConfig

REPO = Path(__file__).resolve().parents[2]
SYSTEMD = REPO / "systemd"
UNIT = SYSTEMD / "gpusnapd.service"
EXAMPLE_CONFIG = SYSTEMD / "gpusnapd.toml"
SYSUSERS = SYSTEMD / "gpusnap.sysusers.conf"
TMPFILES = SYSTEMD / "gpusnapd.tmpfiles.conf"
INSTALL = REPO / "scripts" / "install-service.sh"
EXEC_START = "/usr/local/bin/gpusnapd --config /etc/gpusnap/gpusnapd.toml"

# Settings whose effect is inherited by every process gpusnapd forks -- and so by the restored
# workers, which are its descendants -- or that confine the whole unit cgroup the workers live in.
# Mount namespaces: restored workers would start in gpusnapd's private mount namespace (read-only
# /usr, private /tmp, no /dev/nvidia*, ...), and CRIU restores files by path.
MOUNT_SANDBOXING = {
    "PrivateTmp",
    "ProtectSystem",
    "ProtectHome",
    "PrivateDevices",
    "PrivateMounts",
    "ProtectKernelTunables",
    "ProtectKernelModules",
    "ProtectKernelLogs",
    "ProtectControlGroups",
    "ProtectProc",
    "ProcSubset",
    "ReadOnlyPaths",
    "ReadWritePaths",
    "InaccessiblePaths",
    "ExecPaths",
    "NoExecPaths",
    "TemporaryFileSystem",
    "BindPaths",
    "BindReadOnlyPaths",
    "RootDirectory",
    "RootImage",
    "MountAPIVFS",
    "MountFlags",
    "DynamicUser",
}
OTHER_NAMESPACES = {"PrivateNetwork", "PrivateIPC", "PrivateUsers", "ProtectHostname", "NetworkNamespacePath"}
SECCOMP = {
    "SystemCallFilter",
    "SystemCallArchitectures",
    "SystemCallLog",
    "RestrictNamespaces",
    "RestrictAddressFamilies",
    "MemoryDenyWriteExecute",
    "LockPersonality",
    "RestrictRealtime",
    "RestrictSUIDSGID",
    "ProtectClock",
}
CAPABILITIES_AND_IDENTITY = {"CapabilityBoundingSet", "AmbientCapabilities", "User", "Group", "SecureBits"}
CGROUP_LIMITS = {
    "DevicePolicy",
    "DeviceAllow",
    "IPAddressDeny",
    "IPAddressAllow",
    "MemoryMax",
    "MemoryHigh",
    "MemorySwapMax",
    "CPUQuota",
    "RestrictNetworkInterfaces",
    "SocketBindDeny",
}
FORBIDDEN = MOUNT_SANDBOXING | OTHER_NAMESPACES | SECCOMP | CAPABILITIES_AND_IDENTITY | CGROUP_LIMITS


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """Sections -> key -> values (in order; systemd keys may repeat). Comments and blank lines
    are skipped, trailing-backslash continuations joined; raises ValueError on lines that are no
    ``[Section]`` and no ``Key=value``."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    pending = ""
    for number, raw in enumerate(text.splitlines(), 1):
        line = pending + raw.strip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1].rstrip() + " "
            continue
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, sep, value = line.partition("=")
        if not sep or current is None or not re.fullmatch(r"[A-Za-z][A-Za-z0-9]*", key.strip()):
            raise ValueError(f"line {number}: not a [Section] or Key=value line: {raw!r}")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def unit() -> dict[str, dict[str, list[str]]]:
    return parse_unit(UNIT.read_text())


def one(section: str, key: str) -> str:
    values = unit().get(section, {}).get(key)
    assert values, f"[{section}] {key}= missing in {UNIT.name}"
    assert len(values) == 1, f"[{section}] {key}= set {len(values)} times"
    return values[0]


def test_parser_rejects_garbage() -> None:
    with pytest.raises(ValueError):
        parse_unit("[Service]\nType notify\n")
    assert parse_unit("[Service]\n# c\nExecStart=/bin/a \\\n  b\n") == {"Service": {"ExecStart": ["/bin/a b"]}}


def test_unit_sections() -> None:
    assert set(unit()) == {"Unit", "Service", "Install"}
    assert one("Install", "WantedBy") == "multi-user.target"
    assert one("Unit", "Description")


def test_unit_notify_and_exec() -> None:
    assert one("Service", "Type") == "notify"  # gpusnapd sends READY=1 through sdnotify
    assert one("Service", "NotifyAccess") == "main"  # not the CRIU helpers or restored workers
    assert one("Service", "ExecStart") == EXEC_START


def test_unit_restart_policy() -> None:
    assert one("Service", "Restart") == "on-failure"
    assert one("Service", "RestartSec")
    assert one("Service", "TimeoutStopSec")


def test_restored_trees_survive_daemon_restarts() -> None:
    # Only the main process is signalled on stop/restart; restored trees stay in the cgroup.
    assert one("Service", "KillMode") == "process"
    assert one("Service", "Delegate") == "yes"
    # Every thread of every restored worker counts against the unit's pids limit.
    assert one("Service", "TasksMax") == "infinity"


def test_unit_directories() -> None:
    assert one("Service", "RuntimeDirectory") == "gpusnap"  # /run/gpusnap: the default socket
    assert one("Service", "RuntimeDirectoryMode") == "0755"
    assert one("Service", "RuntimeDirectoryPreserve") == "yes"
    assert one("Service", "StateDirectory") == "gpusnap"  # /var/lib/gpusnap: the default store
    assert one("Service", "StateDirectoryMode") == "0700"
    defaults = DaemonConfig()
    assert defaults.socket == Path("/run/gpusnap/gpusnapd.sock")
    assert defaults.store == Path("/var/lib/gpusnap")


def test_no_sandboxing_that_leaks_into_restored_workers() -> None:
    """Mount/namespace sandboxing, seccomp, capability limits and cgroup limits would all be
    inherited by (or imposed on) the restored workers; see the comment at the top of the unit."""
    keys = {key for section in unit().values() for key in section}
    assert not keys & FORBIDDEN, f"inherited sandboxing in {UNIT.name}: {sorted(keys & FORBIDDEN)}"
    # no_new_privs can never be cleared again, not even by CRIU.
    assert unit()["Service"].get("NoNewPrivileges", ["no"]) == ["no"]


def test_unit_resource_settings() -> None:
    assert int(one("Service", "OOMScoreAdjust")) < 0
    assert one("Service", "LimitMEMLOCK") == "infinity"
    assert int(one("Service", "LimitNOFILE")) >= 65536


def _verify(unit_file: Path) -> tuple[int, list[str]]:
    res = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(unit_file)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    # Messages about the file under test; other lines (about the host's own units, a missing
    # running manager, ...) are not ours.
    ours = [line for line in (res.stdout + res.stderr).splitlines() if unit_file.name in line]
    return res.returncode, ours


def _verifiable_copy(tmp_path: Path, text: str) -> Path:
    """The unit with ExecStart's binary replaced by /bin/true (gpusnapd is not installed here);
    the file keeps its name, which systemd-analyze derives the unit name from."""
    assert EXEC_START in text
    copy = tmp_path / UNIT.name
    copy.write_text(text.replace("ExecStart=/usr/local/bin/gpusnapd ", "ExecStart=/bin/true "))
    return copy


@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed (apt-get install systemd)"
)
def test_systemd_analyze_verify(tmp_path: Path) -> None:
    rc, messages = _verify(_verifiable_copy(tmp_path, UNIT.read_text()))
    assert rc == 0 and not messages, "\n".join(messages)


@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed (apt-get install systemd)"
)
@pytest.mark.parametrize(
    "breakage",
    [
        ("KillMode=process", "KillMode=process\nKilMode=process"),  # unknown key
        ("TasksMax=infinity", "TasksMax=lots"),  # invalid value
        ("[Service]", "[Service"),  # broken section header
    ],
    ids=["unknown-key", "bad-value", "bad-section"],
)
def test_systemd_analyze_verify_catches_errors(tmp_path: Path, breakage: tuple[str, str]) -> None:
    """The verify test above is meaningful: the same check flags a broken copy of the unit."""
    old, new = breakage
    text = UNIT.read_text()
    assert old in text
    rc, messages = _verify(_verifiable_copy(tmp_path, text.replace(old, new, 1)))
    assert rc != 0 or messages


@pytest.mark.skipif(
    shutil.which("systemd-sysusers") is None, reason="systemd-sysusers not installed (apt-get install systemd)"
)
@pytest.mark.skipif(os.geteuid() != 0, reason="systemd-sysusers --root needs root")
def test_sysusers_creates_group(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    subprocess.run(["systemd-sysusers", f"--root={tmp_path}", str(SYSUSERS)], check=True, timeout=60)
    groups = [line.split(":")[0] for line in (tmp_path / "etc" / "group").read_text().splitlines()]
    assert groups == ["gpusnap"]
    assert DaemonConfig().socket_group == "gpusnap"


@pytest.mark.skipif(
    shutil.which("systemd-tmpfiles") is None, reason="systemd-tmpfiles not installed (apt-get install systemd)"
)
@pytest.mark.skipif(os.geteuid() != 0, reason="systemd-tmpfiles --root chowns to root: needs root")
def test_tmpfiles_creates_directories(tmp_path: Path) -> None:
    res = subprocess.run(
        ["systemd-tmpfiles", "--create", f"--root={tmp_path}", str(TMPFILES)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0 and not res.stderr.strip(), res.stderr
    assert stat.S_IMODE((tmp_path / "run" / "gpusnap").stat().st_mode) == 0o755
    assert stat.S_IMODE((tmp_path / "var" / "lib" / "gpusnap").stat().st_mode) == 0o700


def _uncomment_keys(text: str) -> str:
    """The example config with every ``# key = value`` line (and the ``# [park]`` header) made active."""
    return re.sub(r"(?m)^# ([a-z_]+ = |\[park\]$)", r"\1", text)


def test_example_config_documents_every_key_with_its_default(tmp_path: Path) -> None:
    text = EXAMPLE_CONFIG.read_text()
    assert tomllib.loads(text) == {}, "every key of the example must be commented out"
    doc = tomllib.loads(_uncomment_keys(text))
    doc.update({f"park_{k}": v for k, v in doc.pop("park").items()})  # the [park] section
    fields = {f.name for f in dataclasses.fields(DaemonConfig)}
    assert set(doc) == fields
    active = tmp_path / "gpusnapd.toml"
    active.write_text(_uncomment_keys(text))
    assert DaemonConfig.load(active, env={}) == DaemonConfig()


def test_shell_scripts_are_executable() -> None:
    for script in (INSTALL, REPO / "scripts" / "install-criu.sh"):
        assert os.access(script, os.X_OK), f"{script} is not executable (make runs it directly)"


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed (apt-get install shellcheck)")
def test_shellcheck() -> None:
    res = subprocess.run(
        ["shellcheck", "scripts/install-service.sh", "scripts/install-criu.sh"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stdout + res.stderr


# ---------------------------------------------------------------------------------------------
# scripts/install-service.sh, staged into DESTDIR without the venv and CRIU steps
# ---------------------------------------------------------------------------------------------

TRAPPED = ("systemctl", "systemd-sysusers", "systemd-tmpfiles", "groupadd", "apt-get", "pip")


def _run_install(
    tmp_path: Path, destdir: Path | None, *, wrapper: list[str] | None = None, **env: str
) -> subprocess.CompletedProcess[str]:
    """Run the installer with SKIP_PIP/SKIP_CRIU; the commands in TRAPPED are replaced by stubs
    that record their calls in tmp_path/calls (a staged install must not call any of them).
    The systemctl stub reports the unit inactive."""
    stubs = tmp_path / "stubs"
    stubs.mkdir(exist_ok=True)
    for name in TRAPPED:
        stub = stubs / name
        inactive = '[ "$1" = is-active ] && exit 3\n' if name == "systemctl" else ""
        stub.write_text(f'#!/bin/sh\necho "{name} $*" >>"{tmp_path}/calls"\n{inactive}exit 0\n')
        stub.chmod(0o755)
    full_env = {
        "PATH": f"{stubs}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "HOME": str(tmp_path),
        "GPUSNAP_INSTALL_SKIP_PIP": "1",
        "GPUSNAP_INSTALL_SKIP_CRIU": "1",
        **env,
    }
    if destdir is not None:
        full_env["DESTDIR"] = str(destdir)
    cmd = [*(wrapper or []), str(INSTALL)]
    return subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=120)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_install_service_destdir(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    res = _run_install(tmp_path, dest)
    assert res.returncode == 0, res.stderr
    assert not (tmp_path / "calls").exists(), (tmp_path / "calls").read_text()

    unit_file = dest / "etc/systemd/system/gpusnapd.service"
    assert unit_file.read_text() == UNIT.read_text()  # default paths: installed unchanged
    assert _mode(unit_file) == 0o644
    assert (dest / "etc/sysusers.d/gpusnap.conf").read_text() == SYSUSERS.read_text()
    assert (dest / "etc/tmpfiles.d/gpusnap.conf").read_text() == TMPFILES.read_text()
    for f in ("etc/sysusers.d/gpusnap.conf", "etc/tmpfiles.d/gpusnap.conf"):
        assert _mode(dest / f) == 0o644

    for cmd in ("gpusnapd", "gpusnap"):
        link = dest / "usr/local/bin" / cmd
        assert link.is_symlink() and os.readlink(link) == f"/opt/gpusnap/bin/{cmd}"

    conf = dest / "etc/gpusnap/gpusnapd.toml"
    assert _mode(conf) == 0o644 and _mode(conf.parent) == 0o755
    assert tomllib.loads(conf.read_text()) == {
        "criu_binary": "/opt/gpusnap/criu/bin/criu",
        "pycriu_path": "/opt/gpusnap/criu/python",
    }
    config = DaemonConfig.load(conf, env={})
    assert config.criu_binary == "/opt/gpusnap/criu/bin/criu"
    assert config.pycriu_path == "/opt/gpusnap/criu/python"

    # Nothing else was created, and no temporary files were left behind.
    created = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if not p.is_dir())
    assert created == [
        "etc/gpusnap/gpusnapd.toml",
        "etc/systemd/system/gpusnapd.service",
        "etc/sysusers.d/gpusnap.conf",
        "etc/tmpfiles.d/gpusnap.conf",
        "usr/local/bin/gpusnap",
        "usr/local/bin/gpusnapd",
    ]

    # Re-running upgrades in place and keeps an edited configuration.
    conf.write_text('log_level = "debug"\n')
    res = _run_install(tmp_path, dest)
    assert res.returncode == 0, res.stderr
    assert conf.read_text() == 'log_level = "debug"\n'
    assert not (tmp_path / "calls").exists()


def test_install_service_custom_paths(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    res = _run_install(
        tmp_path,
        dest,
        PREFIX="/srv/gs/",
        BINDIR="/usr/bin",
        SYSCONFDIR="/etc/gs",
        UNITDIR="/usr/lib/systemd/system",
        SYSUSERSDIR="/usr/lib/sysusers.d",
        TMPFILESDIR="/usr/lib/tmpfiles.d",
    )
    assert res.returncode == 0, res.stderr
    installed = (dest / "usr/lib/systemd/system/gpusnapd.service").read_text()
    assert installed == UNIT.read_text().replace(
        f"ExecStart={EXEC_START}", "ExecStart=/usr/bin/gpusnapd --config /etc/gs/gpusnapd.toml"
    )
    assert os.readlink(dest / "usr/bin/gpusnapd") == "/srv/gs/bin/gpusnapd"
    assert (dest / "usr/lib/sysusers.d/gpusnap.conf").exists()
    assert (dest / "usr/lib/tmpfiles.d/gpusnap.conf").exists()
    assert tomllib.loads((dest / "etc/gs/gpusnapd.toml").read_text()) == {
        "criu_binary": "/srv/gs/criu/bin/criu",
        "pycriu_path": "/srv/gs/criu/python",
    }


def test_install_service_rejects_relative_paths(tmp_path: Path) -> None:
    res = _run_install(tmp_path, tmp_path / "dest", PREFIX="opt/gpusnap")
    assert res.returncode != 0
    assert "PREFIX must be an absolute path" in res.stderr
    assert not (tmp_path / "dest").exists()


def _private_run(systemd_pid1: bool) -> list[str]:
    """A command prefix that runs the installer in a private mount namespace with an empty /run,
    where /run/systemd/system (the sd_booted() marker) exists or not."""
    marker = "mkdir -p /run/systemd/system && " if systemd_pid1 else ""
    script = f'mount -t tmpfs tmpfs /run && {marker}exec "$0"'
    return ["unshare", "--mount", "--propagation", "private", "bash", "-c", script]


def _can_unshare_mount() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    res = subprocess.run([*_private_run(False)[:-1], "mount -t tmpfs tmpfs /run"], capture_output=True, timeout=30)
    return res.returncode == 0


def _host_paths(tmp_path: Path) -> dict[str, str]:
    root = tmp_path / "root"
    return {
        "PREFIX": f"{root}/opt/gpusnap",
        "BINDIR": f"{root}/bin",
        "SYSCONFDIR": f"{root}/etc/gpusnap",
        "UNITDIR": f"{root}/etc/systemd/system",
        "SYSUSERSDIR": f"{root}/etc/sysusers.d",
        "TMPFILESDIR": f"{root}/etc/tmpfiles.d",
    }


@pytest.mark.skipif(not _can_unshare_mount(), reason="needs root and mount namespaces (unshare --mount)")
@pytest.mark.parametrize("systemd_pid1", [True, False], ids=["systemd-running", "no-systemd"])
def test_install_service_on_host(tmp_path: Path, systemd_pid1: bool) -> None:
    """Without DESTDIR: creates the group and directories, then enables and starts the unit only
    when systemd is PID 1 (all paths in tmp_path, system commands stubbed)."""
    paths = _host_paths(tmp_path)
    res = _run_install(tmp_path, None, wrapper=_private_run(systemd_pid1), **paths)
    assert res.returncode == 0, res.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    expected = [
        f"systemd-sysusers {paths['SYSUSERSDIR']}/gpusnap.conf",
        f"systemd-tmpfiles --create {paths['TMPFILESDIR']}/gpusnap.conf",
    ]
    if systemd_pid1:
        expected += [
            "systemctl daemon-reload",
            "systemctl is-active --quiet gpusnapd.service",
            "systemctl enable --now gpusnapd.service",
            "systemctl --no-pager --lines=0 status gpusnapd.service",
        ]
    else:
        assert "systemctl daemon-reload && systemctl enable --now gpusnapd.service" in res.stderr
    assert calls == expected
    unit_text = (Path(paths["UNITDIR"]) / "gpusnapd.service").read_text()
    assert f"ExecStart={paths['BINDIR']}/gpusnapd --config {paths['SYSCONFDIR']}/gpusnapd.toml" in unit_text
