#!/usr/bin/env bash
# install-service.sh -- install gpusnapd as a systemd service (run as root;
# `make install-service` runs it).
#
# What it does:
#   1. PREFIX (/opt/gpusnap): a Python virtual environment with gpusnap from
#      this checkout installed into it (non-editable).
#   2. PREFIX/criu: a private CRIU >= 4.2 + pycriu (scripts/install-criu.sh: the
#      system's packages where new enough, else Debian forky's).
#   3. SYSCONFDIR/gpusnapd.toml (/etc/gpusnap) from systemd/gpusnapd.toml with
#      criu_binary and pycriu_path pointing at PREFIX/criu -- only if missing;
#      an existing configuration is never touched.
#   4. BINDIR/gpusnapd and BINDIR/gpusnap (/usr/local/bin): symlinks into
#      PREFIX/bin.
#   5. The unit (UNITDIR, /etc/systemd/system), the sysusers.d and tmpfiles.d
#      snippets (SYSUSERSDIR /etc/sysusers.d, TMPFILESDIR /etc/tmpfiles.d);
#      then creates the "gpusnap" group and the /run/gpusnap and
#      /var/lib/gpusnap directories.
#   6. When systemd is running as PID 1: `systemctl daemon-reload`, then
#      `systemctl enable --now gpusnapd.service` (or a restart when it is
#      already running: restored workers survive it, KillMode=process).
#      Otherwise it prints the commands to run once systemd is up.
#
# Re-running it upgrades the installation in place.
#
# Environment:
#   DESTDIR=DIR   stage everything below DIR (packaging / dry runs): nothing
#                 outside DIR is changed (except that install-criu.sh may
#                 apt-get criu on distributions that ship criu >= 4.2), no
#                 group is created, systemctl is never called; root is not
#                 required.  The venv's scripts are rewritten to run from
#                 PREFIX (without DESTDIR) once the tree is moved there.
#   PREFIX        venv + CRIU location          (default /opt/gpusnap)
#   BINDIR        symlinks                      (default /usr/local/bin)
#   SYSCONFDIR    configuration                 (default /etc/gpusnap)
#   UNITDIR       systemd unit                  (default /etc/systemd/system;
#                                                packages: /usr/lib/systemd/system)
#   SYSUSERSDIR   sysusers.d snippet            (default /etc/sysusers.d)
#   TMPFILESDIR   tmpfiles.d snippet            (default /etc/tmpfiles.d)
#   PYTHON        interpreter for the venv, >= 3.11 (default /usr/bin/python3
#                 when it is new enough, else python3 on PATH: a venv keeps
#                 using its base interpreter, so prefer the system one over a
#                 pyenv/conda one in somebody's home directory)
#   GPUSNAP_INSTALL_SKIP_PIP=1    do not create/update the venv
#   GPUSNAP_INSTALL_SKIP_CRIU=1   do not run install-criu.sh
#   GPUSNAP_INSTALL_NO_START=1    do not enable/start the service

set -euo pipefail

script_dir=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd -P)
repo_root=$(dirname -- "$script_dir")

DESTDIR=${DESTDIR:-}
DESTDIR=${DESTDIR%/}
PREFIX=${PREFIX:-/opt/gpusnap}
BINDIR=${BINDIR:-/usr/local/bin}
SYSCONFDIR=${SYSCONFDIR:-/etc/gpusnap}
UNITDIR=${UNITDIR:-/etc/systemd/system}
SYSUSERSDIR=${SYSUSERSDIR:-/etc/sysusers.d}
TMPFILESDIR=${TMPFILESDIR:-/etc/tmpfiles.d}
PYTHON=${PYTHON:-}

UNIT=gpusnapd.service
RUNTIME_DIR=/run/gpusnap
STATE_DIR=/var/lib/gpusnap

log() { printf 'install-service: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

# Temporary files (written next to their destination, then renamed into
# place) are removed if the script fails half-way.
tmp_files=()
cleanup() { ((${#tmp_files[@]} == 0)) || rm -rf -- "${tmp_files[@]}"; }
trap cleanup EXIT
# new_tmp FILE: create a temporary file next to FILE; its name goes to $tmp.
new_tmp() {
    tmp=$(mktemp "$1.XXXXXX")
    tmp_files+=("$tmp")
}

# All installation paths must be absolute (they end up in the unit/config).
for var in PREFIX BINDIR SYSCONFDIR UNITDIR SYSUSERSDIR TMPFILESDIR; do
    case ${!var} in
        /*) ;;
        *) die "$var must be an absolute path, not '${!var}'" ;;
    esac
    # Strip trailing slashes (but keep "/").
    [[ ${!var} == / ]] || printf -v "$var" '%s' "${!var%/}"
done
if [[ -n $DESTDIR ]]; then
    case $DESTDIR in
        /*) ;;
        *) DESTDIR=$PWD/$DESTDIR ;;
    esac
fi

[[ -n $DESTDIR || $EUID == 0 ]] || die "run as root (or set DESTDIR for a staged install)"

# Is systemd the running init system?  (The sd_booted(3) test.)
systemd_running() { [[ -d /run/systemd/system ]]; }

# ---------------------------------------------------------------------------
# 1. Python virtual environment with gpusnap
# ---------------------------------------------------------------------------

python_ok() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; }

install_venv() {
    local venv=$DESTDIR$PREFIX
    if [[ -z $PYTHON ]]; then
        PYTHON=python3
        python_ok /usr/bin/python3 && PYTHON=/usr/bin/python3
    fi
    python_ok "$PYTHON" || die "$PYTHON does not run or is older than 3.11 (set PYTHON=...)"
    if [[ ! -f $venv/pyvenv.cfg ]]; then
        if [[ -d $venv && -n $(ls -A -- "$venv") ]]; then
            die "$venv exists and is not a virtual environment; refusing to use it"
        fi
        log "creating virtual environment $venv"
        "$PYTHON" -m venv "$venv" ||
            die "'$PYTHON -m venv' failed (Debian/Ubuntu: apt-get install python3-venv)"
    fi
    # pip builds in the source tree (build/, *.egg-info); build from a copy so
    # that `sudo make install-service` leaves no root-owned files in the
    # user's checkout.
    local src
    src=$(mktemp -d)
    tmp_files+=("$src")
    tar -C "$repo_root" -cf - \
        --anchored --exclude=./.git --exclude=./.venv --exclude=./.criu \
        --exclude='./.criu.tmp.*' --exclude=./build --exclude=./dist --exclude=./.whl \
        --exclude=./.mypy_src --exclude=./.mypy_cache --exclude=./.pytest_cache --exclude=./.ruff_cache \
        --exclude=./.gl \
        --no-anchored --exclude=__pycache__ --exclude='*.egg-info' . |
        tar -C "$src" -xf -
    log "installing gpusnap from $repo_root into $venv"
    "$venv/bin/python" -m pip install -q --upgrade pip ||
        log "warning: could not upgrade pip in $venv; continuing with its pip"
    "$venv/bin/python" -m pip install -q --upgrade "$src"
    "$venv/bin/gpusnapd" --version >/dev/null || die "$venv/bin/gpusnapd does not run"

    if [[ -n $DESTDIR ]]; then
        # Scripts in a venv carry its absolute path (shebangs, activate); make
        # them refer to PREFIX, where the staged tree will finally live.  (The
        # venv itself finds its packages relative to bin/python.)
        local f
        while IFS= read -r -d '' f; do
            if grep -qF -- "$venv" "$f"; then
                sed -i "s|$venv|$PREFIX|g" "$f"
            fi
        done < <(find "$venv/bin" "$venv/pyvenv.cfg" -maxdepth 1 -type f -print0)
    fi
}

# ---------------------------------------------------------------------------
# 2. CRIU
# ---------------------------------------------------------------------------

install_criu() {
    log "installing CRIU into $DESTDIR$PREFIX/criu"
    "$script_dir/install-criu.sh" "$DESTDIR$PREFIX/criu"
}

# ---------------------------------------------------------------------------
# 3. Configuration
# ---------------------------------------------------------------------------

install_config() {
    local conf=$DESTDIR$SYSCONFDIR/gpusnapd.toml
    install -d -m 0755 "$DESTDIR$SYSCONFDIR"
    if [[ -e $conf ]]; then
        log "keeping existing $conf"
        return 0
    fi
    log "writing $conf"
    local tmp
    new_tmp "$conf"
    # Activate the two CRIU keys (commented out in the example).
    sed -e "s|^#[[:space:]]*criu_binary[[:space:]]*=.*|criu_binary = \"$PREFIX/criu/bin/criu\"|" \
        -e "s|^#[[:space:]]*pycriu_path[[:space:]]*=.*|pycriu_path = \"$PREFIX/criu/python\"|" \
        "$repo_root/systemd/gpusnapd.toml" >"$tmp"
    if ! grep -q '^criu_binary = ' "$tmp" || ! grep -q '^pycriu_path = ' "$tmp"; then
        die "systemd/gpusnapd.toml lacks the criu_binary/pycriu_path lines"
    fi
    chmod 0644 "$tmp"
    mv -- "$tmp" "$conf"
}

# ---------------------------------------------------------------------------
# 4. Commands
# ---------------------------------------------------------------------------

install_links() {
    install -d -m 0755 "$DESTDIR$BINDIR"
    local cmd
    for cmd in gpusnapd gpusnap; do
        ln -sfn -- "$PREFIX/bin/$cmd" "$DESTDIR$BINDIR/$cmd"
    done
}

# ---------------------------------------------------------------------------
# 5. systemd files, group, directories
# ---------------------------------------------------------------------------

install_systemd_files() {
    local tmp unit=$DESTDIR$UNITDIR/$UNIT
    install -d -m 0755 "$DESTDIR$UNITDIR" "$DESTDIR$SYSUSERSDIR" "$DESTDIR$TMPFILESDIR"
    new_tmp "$unit"
    sed -e "s|^ExecStart=/usr/local/bin/gpusnapd --config /etc/gpusnap/gpusnapd.toml\$|ExecStart=$BINDIR/gpusnapd --config $SYSCONFDIR/gpusnapd.toml|" \
        "$repo_root/systemd/$UNIT" >"$tmp"
    grep -qxF "ExecStart=$BINDIR/gpusnapd --config $SYSCONFDIR/gpusnapd.toml" "$tmp" ||
        die "could not set ExecStart= in $UNIT"
    chmod 0644 "$tmp"
    mv -- "$tmp" "$unit"
    install -m 0644 "$repo_root/systemd/gpusnap.sysusers.conf" "$DESTDIR$SYSUSERSDIR/gpusnap.conf"
    install -m 0644 "$repo_root/systemd/gpusnapd.tmpfiles.conf" "$DESTDIR$TMPFILESDIR/gpusnap.conf"
    log "installed $unit, $DESTDIR$SYSUSERSDIR/gpusnap.conf, $DESTDIR$TMPFILESDIR/gpusnap.conf"
}

create_group_and_dirs() {
    if command -v systemd-sysusers >/dev/null 2>&1; then
        systemd-sysusers "$SYSUSERSDIR/gpusnap.conf"
    elif ! getent group gpusnap >/dev/null; then
        groupadd --system gpusnap
    fi
    if command -v systemd-tmpfiles >/dev/null 2>&1; then
        systemd-tmpfiles --create "$TMPFILESDIR/gpusnap.conf"
    else
        install -d -m 0755 "$RUNTIME_DIR"
        install -d -m 0700 "$STATE_DIR"
    fi
}

# ---------------------------------------------------------------------------
# 6. Service
# ---------------------------------------------------------------------------

start_service() {
    systemctl daemon-reload
    if systemctl is-active --quiet "$UNIT"; then
        systemctl enable "$UNIT"
        log "restarting $UNIT (restored workers keep running)"
        systemctl restart "$UNIT"
    else
        systemctl enable --now "$UNIT"
    fi
    systemctl --no-pager --lines=0 status "$UNIT" || true
}

# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------

[[ -n $DESTDIR ]] && log "staging into DESTDIR=$DESTDIR"

if [[ ${GPUSNAP_INSTALL_SKIP_PIP:-0} == 1 ]]; then
    log "GPUSNAP_INSTALL_SKIP_PIP=1: not installing the virtual environment"
else
    install_venv
fi
if [[ ${GPUSNAP_INSTALL_SKIP_CRIU:-0} == 1 ]]; then
    log "GPUSNAP_INSTALL_SKIP_CRIU=1: not installing CRIU"
else
    install_criu
fi
install_config
install_links
install_systemd_files

if [[ -n $DESTDIR ]]; then
    log "staged in $DESTDIR; on the target system run:"
    log "  systemd-sysusers $SYSUSERSDIR/gpusnap.conf && systemd-tmpfiles --create $TMPFILESDIR/gpusnap.conf"
    log "  systemctl daemon-reload && systemctl enable --now $UNIT"
    exit 0
fi

create_group_and_dirs

if [[ ${GPUSNAP_INSTALL_NO_START:-0} == 1 ]]; then
    log "GPUSNAP_INSTALL_NO_START=1: to start it run: systemctl daemon-reload && systemctl enable --now $UNIT"
elif systemd_running; then
    start_service
else
    log "systemd is not running as PID 1 here, so the service was not enabled or started."
    log "Once systemd runs, do:  systemctl daemon-reload && systemctl enable --now $UNIT"
    log "Or run the daemon in the foreground:  $BINDIR/gpusnapd --config $SYSCONFDIR/gpusnapd.toml"
fi
log "add API users to the gpusnap group:  usermod -aG gpusnap USER"
