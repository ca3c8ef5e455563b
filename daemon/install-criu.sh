#!/usr/bin/env bash
# install-criu.sh -- install CRIU >= 4.2 and pycriu into a private prefix.
#
# Usage: scripts/install-criu.sh [PREFIX]       (a checkout; `make criu`)
#        gpusnap-install-criu [PREFIX]          (an installed gpusnap: this file, bundled in the
#                                                package as gpusnap/daemon/install-criu.sh)
#
#   PREFIX  defaults to $GPUSNAP_CRIU_PREFIX, else <repo>/.criu (gpusnap-install-criu:
#           /opt/gpusnap/criu)
#
# Result (the prefix is relocatable: it can be moved or copied with `cp -a`):
#   PREFIX/bin/criu      wrapper; run it instead of a system criu
#   PREFIX/python/       put on PYTHONPATH for `import pycriu`; pycriu's generated
#                        code needs google.protobuf >= 3.20 (tested up to 7.36)
#   PREFIX/VERSION       the criu version, e.g. 4.2.1
#
# Strategy:
# Why 4.2: CRIU <= 4.1 cannot run on Linux >= 6.13 (vDSO, criu#2532) and CRIU 4.1.x
# cannot dump any process holding an inet socket on Linux >= 6.16 ("sockets: Can't get
# 1:16 opt: Operation not supported", criu#2718, fixed in 4.2). Inference workers always
# hold TCP sockets, so 4.2 is the floor.
#
#   * If the distribution itself offers criu >= 4.2 (Debian 14, ...), install
#     `criu` and `python3-pycriu` with apt and make PREFIX a thin wrapper
#     around /usr/sbin/criu and the system pycriu.
#   * Otherwise (Debian 12, Ubuntu 24.04, ...), use a separate, private apt
#     configuration for Debian "forky" (testing; the system's sources are not
#     touched and nothing is installed into the system) to download criu,
#     python3-pycriu and criu's whole shared-library closure down to libc6,
#     then unpack them with `dpkg -x`.  bin/criu runs criu through the
#     prefix's own dynamic loader with --library-path, so the host glibc is
#     irrelevant and programs criu spawns (ip, iptables, ...) still use the
#     host's libraries.
#
# Downloaded .debs are cached (and reused) in
#   ${XDG_CACHE_HOME:-$HOME/.cache}/gpusnap/debs
# together with a sha256 manifest; set GPUSNAP_CRIU_REFRESH=1 to ignore the
# manifest and resolve the newest versions of the suite again.
#
# Other knobs (environment):
#   GPUSNAP_CRIU_FORCE=1        reinstall even if PREFIX looks complete
#   GPUSNAP_DEBIAN_MIRROR=URL   Debian mirror (default http://deb.debian.org/debian)
#   GPUSNAP_DEBIAN_SUITE=NAME   Debian suite to take criu from (default forky)
#
# Re-running with a complete prefix is a quick no-op.

set -euo pipefail

MIN_VERSION=4.2
SUITE=${GPUSNAP_DEBIAN_SUITE:-forky}
MIRROR=${GPUSNAP_DEBIAN_MIRROR:-http://deb.debian.org/debian}
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg

script_dir=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd -P)
repo_root=$(dirname -- "$script_dir")
prefix=${1:-${GPUSNAP_CRIU_PREFIX:-$repo_root/.criu}}
# Make the prefix absolute (it need not exist yet).
case $prefix in
    /*) ;;
    *) prefix=$PWD/$prefix ;;
esac
prefix=${prefix%/}

cache_dir=${XDG_CACHE_HOME:-${HOME:?HOME is not set}/.cache}/gpusnap
deb_dir=$cache_dir/debs
apt_dir=$cache_dir/apt-$SUITE
manifest=$deb_dir/manifest-$SUITE.sha256

log() { printf 'install-criu: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------

# Print the version reported by a criu binary/wrapper ("4.1.1"), or nothing.
criu_version() {
    "$1" --version 2>/dev/null | sed -n 's/^Version: *//p' | head -n1
}

# Is the existing prefix complete and good?  (The idempotency fast path.)
prefix_complete() {
    [[ -f $prefix/VERSION && -x $prefix/bin/criu && -e $prefix/python/pycriu/__init__.py ]] || return 1
    local want have
    want=$(cat "$prefix/VERSION")
    have=$(criu_version "$prefix/bin/criu")
    [[ -n $have && $have == "$want" ]] && version_ge "$have" "$MIN_VERSION"
}

# version_ge A B: true if Debian version A >= B.
version_ge() { dpkg --compare-versions "$1" ge "$2"; }

system_apt_updated=0
system_apt_update() {
    if [[ $system_apt_updated == 0 && $EUID == 0 ]]; then
        log "apt-get update (system sources)"
        apt-get update -qq
        system_apt_updated=1
    fi
}

# Install missing host tools with apt (root only).
# Arguments: pairs of "command:package".
ensure_tools() {
    local spec cmd pkg missing=()
    for spec in "$@"; do
        cmd=${spec%%:*}
        pkg=${spec#*:}
        if [[ $cmd == /* ]]; then
            [[ -e $cmd ]] || missing+=("$pkg")
        else
            command -v "$cmd" >/dev/null 2>&1 || missing+=("$pkg")
        fi
    done
    ((${#missing[@]} == 0)) && return 0
    [[ $EUID == 0 ]] || die "missing tools (packages: ${missing[*]}); run as root or install them"
    system_apt_update
    log "installing host tools: ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# Final sanity check of a freshly built prefix directory ($1).
verify_prefix() {
    local dir=$1 v
    v=$(criu_version "$dir/bin/criu")
    [[ -n $v ]] || die "$dir/bin/criu --version does not work"
    version_ge "$v" "$MIN_VERSION" || die "criu $v in $dir is older than $MIN_VERSION"
    [[ -e $dir/python/pycriu/__init__.py ]] || die "pycriu missing in $dir/python"
    printf '%s\n' "$v" >"$dir/VERSION"
    log "criu $v ready in $prefix"
}

# ---------------------------------------------------------------------------
# Path 1: the distribution already has criu >= 4.2
# ---------------------------------------------------------------------------

install_from_system() {
    local stage=$1
    log "installing criu and python3-pycriu from the system's apt sources"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        criu python3-pycriu >/dev/null

    mkdir -p "$stage/bin" "$stage/python"
    cat >"$stage/bin/criu" <<'EOF'
#!/bin/sh
# gpusnap CRIU wrapper (generated by scripts/install-criu.sh): system criu.
exec /usr/sbin/criu "$@"
EOF
    chmod 755 "$stage/bin/criu"
    local pkgdir=/usr/lib/python3/dist-packages
    ln -s "$pkgdir/pycriu" "$stage/python/pycriu"
    [[ -d $pkgdir/crit ]] && ln -s "$pkgdir/crit" "$stage/python/crit"
    echo system >"$stage/SOURCE"
}

# ---------------------------------------------------------------------------
# Path 2: private Debian packages (suite $SUITE) unpacked into the prefix
# ---------------------------------------------------------------------------

# Options that give apt-get/apt-cache a configuration of their own: own
# sources list, package lists, caches and (empty) dpkg status, and no system
# preferences.  System apt.conf (e.g. proxy settings) still applies.
apt_opts=()
setup_private_apt() {
    mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial" "$apt_dir/empty.d"
    printf 'deb [arch=amd64 signed-by=%s] %s %s main\n' "$KEYRING" "$MIRROR" "$SUITE" \
        >"$apt_dir/sources.list"
    : >"$apt_dir/status"
    apt_opts=(
        -o "Dir::Etc::SourceList=$apt_dir/sources.list"
        -o "Dir::Etc::SourceParts=$apt_dir/empty.d"
        -o "Dir::Etc::Preferences=$apt_dir/empty.d/none"
        -o "Dir::Etc::PreferencesParts=$apt_dir/empty.d"
        -o "Dir::State::Lists=$apt_dir/lists"
        -o "Dir::State::status=$apt_dir/status"
        -o "Dir::Cache=$apt_dir/cache"
        -o "APT::Architecture=amd64"
        -o "APT::Architectures::=amd64"
        -o "APT::Default-Release="
        -o "Acquire::Languages=none"
    )
    # Our cache lives in $HOME (mode 0700 for root), which the _apt sandbox
    # user cannot enter; download as the invoking user instead.
    [[ $EUID == 0 ]] && apt_opts+=(-o "APT::Sandbox::User=root")
    return 0
}

# Resolve criu's dependency closure in $SUITE and fill $deb_dir with the
# .debs, reusing cached files whose sha256 matches.  Writes $manifest.
download_debs() {
    setup_private_apt
    log "apt-get update (private $SUITE configuration in $apt_dir)"
    apt-get "${apt_opts[@]}" update -qq

    # Recursive Depends/Pre-Depends of criu: shared libraries down to libc6.
    # Lines starting with a space are the dependency edges, "<...>" are
    # virtual packages; what remains is the set of real packages.
    local pkgs
    mapfile -t pkgs < <(
        apt-cache "${apt_opts[@]}" depends --recurse --no-recommends --no-suggests \
            --no-conflicts --no-breaks --no-replaces --no-enhances criu |
            grep -v -e '^ ' -e '^<' | sort -u
    )
    ((${#pkgs[@]} > 1)) || die "could not resolve the dependencies of criu in $SUITE"
    pkgs+=(python3-pycriu)
    log "packages: ${pkgs[*]}"

    # "'URI' FILE SIZE SHA256:HASH" for every package.
    local uris
    uris=$(apt-get "${apt_opts[@]}" download --print-uris "${pkgs[@]}")

    local new_manifest=$manifest.new.$$ file hash need=()
    : >"$new_manifest"
    while read -r _ file _ hash; do
        hash=${hash#SHA256:}
        [[ ${#hash} == 64 ]] || die "no SHA256 for $file in apt output"
        printf '%s  %s\n' "$hash" "$file" >>"$new_manifest"
        if [[ -f $deb_dir/$file ]] &&
            [[ $(sha256sum "$deb_dir/$file" | cut -d' ' -f1) == "$hash" ]]; then
            continue
        fi
        need+=("${file%%_*}")
    done <<<"$uris"

    if ((${#need[@]})); then
        log "downloading ${#need[@]} package(s) into $deb_dir"
        # apt-get download verifies the hashes from the signed Release file.
        (cd "$deb_dir" && apt-get "${apt_opts[@]}" download -qq "${need[@]}")
    else
        log "all packages already cached in $deb_dir"
    fi
    (cd "$deb_dir" && sha256sum --check --quiet "$new_manifest") ||
        die "downloaded packages do not match their checksums"
    mv -f "$new_manifest" "$manifest"
}

install_from_debs() {
    local stage=$1
    [[ $(uname -m) == x86_64 ]] || die "the private criu build is only supported on x86_64"
    mkdir -p "$deb_dir"

    if [[ ${GPUSNAP_CRIU_REFRESH:-0} != 1 && -s $manifest ]] &&
        (cd "$deb_dir" && sha256sum --check --quiet --status "$manifest" 2>/dev/null); then
        log "using cached packages listed in $manifest"
    else
        ensure_tools gpgv:gpgv "$KEYRING:debian-archive-keyring"
        download_debs
    fi

    local file
    while read -r _ file; do
        dpkg-deb -x "$deb_dir/$file" "$stage"
    done <"$manifest"
    cp "$manifest" "$stage/debs.sha256"

    local libdir=usr/lib/x86_64-linux-gnu
    [[ -x $stage/usr/sbin/criu && -e $stage/$libdir/ld-linux-x86-64.so.2 ]] ||
        die "unpacked packages lack usr/sbin/criu or the dynamic loader"
    # Debian 13 is merged-/usr: provide the classic lib64/ loader path too.
    [[ -e $stage/lib64 ]] || ln -s usr/lib64 "$stage/lib64"

    mkdir -p "$stage/bin" "$stage/python"
    # gpusnapd runs what this wrapper execs without the shell (gpusnap.daemon.drivers.criu.launch_command
    # knows this layout and the marker line): keep the two in step.
    cat >"$stage/bin/criu" <<'EOF'
#!/bin/sh
# gpusnap CRIU wrapper (generated by scripts/install-criu.sh).
# Runs the prefix's Debian criu with the prefix's own dynamic loader and
# libraries, independent of the host glibc.  Relocatable: every path is
# derived from the location of this script.
self=$(readlink -f -- "$0") || exit 127
prefix=$(dirname -- "$(dirname -- "$self")")
exec "$prefix/lib64/ld-linux-x86-64.so.2" \
    --library-path "$prefix/usr/lib/x86_64-linux-gnu" \
    "$prefix/usr/sbin/criu" "$@"
EOF
    chmod 755 "$stage/bin/criu"

    # pycriu (and crit) as relative symlinks so that the prefix stays movable.
    ln -s ../usr/lib/python3/dist-packages/pycriu "$stage/python/pycriu"
    ln -s ../usr/lib/python3/dist-packages/crit "$stage/python/crit"
    echo "debian-$SUITE" >"$stage/SOURCE"

    # Every shared library criu needs must come from the prefix.
    local missing
    missing=$("$stage/$libdir/ld-linux-x86-64.so.2" --library-path "$stage/$libdir" \
        --list "$stage/usr/sbin/criu" | grep 'not found' || true)
    [[ -z $missing ]] || die "criu has unresolved libraries: $missing"
}

# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------

if [[ ${GPUSNAP_CRIU_FORCE:-0} != 1 ]] && prefix_complete; then
    log "criu $(cat "$prefix/VERSION") already installed in $prefix"
    exit 0
fi

command -v apt-get >/dev/null 2>&1 || die "apt-get not found (Debian/Ubuntu only)"

# Serialise concurrent runs (they share the .deb cache).
mkdir -p "$cache_dir"
exec 9>"$cache_dir/.install-criu.lock"
command -v flock >/dev/null 2>&1 && flock 9

# Never replace a directory that is not an (old or partial) criu prefix.
if [[ -d $prefix && -n $(ls -A -- "$prefix") && ! -e $prefix/bin/criu && ! -e $prefix/SOURCE ]]; then
    die "$prefix exists and does not look like a criu prefix; refusing to replace it"
fi

# Build in a sibling staging directory and move it into place at the end, so
# an interrupted run never leaves a prefix that looks complete.
parent=$(dirname -- "$prefix")
base=$(basename -- "$prefix")
mkdir -p "$parent"
stage=$(mktemp -d "$parent/.${base#.}.tmp.XXXXXX")
chmod 755 "$stage"
trap 'rm -rf -- "$stage"' EXIT

# Does the distribution itself have a new enough criu?
system_apt_update
candidate=$(apt-cache policy criu 2>/dev/null | sed -n 's/^ *Candidate: *//p')
if [[ -n $candidate && $candidate != "(none)" ]] && version_ge "$candidate" "$MIN_VERSION"; then
    [[ $EUID == 0 ]] || die "criu $candidate is available from the system's apt sources; run as root to install it"
    install_from_system "$stage"
else
    log "system criu candidate is '${candidate:-none}' (< $MIN_VERSION); using Debian $SUITE packages"
    install_from_debs "$stage"
fi

verify_prefix "$stage"
rm -rf -- "$prefix"
mv -- "$stage" "$prefix"
trap - EXIT
log "done: $prefix/bin/criu, PYTHONPATH=$prefix/python"
