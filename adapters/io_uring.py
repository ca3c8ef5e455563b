"""block_io_uring(): make ``io_uring_setup`` fail in this process and its future children, so none of them
holds an io_uring instance, which CRIU cannot checkpoint (``anon_inode:[io_uring]``; docs/criu-limits.md).
NVIDIA Dynamo blocks it with a seccomp profile too; vLLM's own snapshot asks for ``kernel.io_uring_disabled=2``.

Where vLLM's io_uring comes from: the API server runs ``uvloop.run(run_server(args))``
(``vllm/entrypoints/launchers/api_server/entry.py``, vLLM 0.32). uvloop 0.23 bundles libuv >= 1.49,
whose ``uv_loop_init`` sets up an io_uring for batching ``epoll_ctl`` calls on Linux: ``uv__use_io_uring``
(``src/unix/linux.c``) answers yes for rings without SQPOLL before it reads ``UV_USE_IO_URING``, so that
variable only governs the file-operation ring. When ``io_uring_setup`` fails, libuv keeps plain
``epoll_ctl`` (the ring stays unset), which is what this module arranges.

How: a seccomp filter (``seccomp(2)``, ``SECCOMP_FILTER_FLAG_TSYNC`` so every thread of the process gets
it) that returns ``ENOSYS`` for ``io_uring_setup`` and allows everything else; children inherit it across
``fork`` and ``exec``, which covers vLLM's spawned EngineCore and Worker processes. Installing a filter
needs ``no_new_privs`` (``prctl(PR_SET_NO_NEW_PRIVS)``): from then on, set-user-ID programs started by the
engine do not gain privileges. CRIU checkpoints and restores both. Only x86-64 and AArch64 are handled;
elsewhere the function returns False and capture preflight reports any io_uring that appears.

vLLM loads its general plugins while it parses ``vllm serve``'s arguments
(``AsyncEngineArgs.add_cli_args`` calls ``load_general_plugins``), before ``uvloop.run`` creates the loop,
so gpusnap's plugin (``gpusnap.adapters.engines.vllm.plugin``) calls this in time.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import platform
import struct

log = logging.getLogger(__name__)

_PR_SET_NO_NEW_PRIVS = 38
_SECCOMP_SET_MODE_FILTER = 1
_SECCOMP_FILTER_FLAG_TSYNC = 1
_NR_IO_URING_SETUP = 425  # the same number on x86-64 and the generic syscall table (AArch64)
_ARCHES = {  # machine -> (AUDIT_ARCH_*, __NR_seccomp)
    "x86_64": (0xC000003E, 317),
    "aarch64": (0xC00000B7, 277),
}
_BPF_LD_W_ABS = 0x20
_BPF_JEQ_K = 0x15
_BPF_RET_K = 0x06
_SECCOMP_RET_ALLOW = 0x7FFF0000
_SECCOMP_RET_ERRNO = 0x00050000
_OFFSET_NR = 0
_OFFSET_ARCH = 4

_installed = False


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k)


def filter_program(audit_arch: int) -> bytes:
    """The classic-BPF program: other architectures and other syscalls are allowed, ``io_uring_setup``
    returns ``ENOSYS``."""
    return b"".join(
        [
            _insn(_BPF_LD_W_ABS, _OFFSET_ARCH),
            _insn(_BPF_JEQ_K, audit_arch, jt=1),
            _insn(_BPF_RET_K, _SECCOMP_RET_ALLOW),
            _insn(_BPF_LD_W_ABS, _OFFSET_NR),
            _insn(_BPF_JEQ_K, _NR_IO_URING_SETUP, jf=1),
            _insn(_BPF_RET_K, _SECCOMP_RET_ERRNO | errno.ENOSYS),
            _insn(_BPF_RET_K, _SECCOMP_RET_ALLOW),
        ]
    )


def block_io_uring() -> bool:
    """Install the filter once per process (see the module docstring); True when it is in place.

    Never raises: where the kernel refuses (no seccomp, an unknown architecture), it logs why and returns
    False.
    """
    global _installed
    if _installed:
        return True
    arch = _ARCHES.get(platform.machine())
    if arch is None:
        log.warning("gpusnap: cannot block io_uring on %s; a capture refuses processes that use it", platform.machine())
        return False
    audit_arch, nr_seccomp = arch
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    code = filter_program(audit_arch)
    program = ctypes.create_string_buffer(code, len(code))
    fprog = _SockFprog(len(code) // 8, ctypes.cast(program, ctypes.c_void_p))
    if (
        libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
        or libc.syscall(nr_seccomp, _SECCOMP_SET_MODE_FILTER, _SECCOMP_FILTER_FLAG_TSYNC, ctypes.byref(fprog)) != 0
    ):
        err = ctypes.get_errno()
        log.warning(
            "gpusnap: cannot block io_uring (seccomp: %s); a capture refuses processes that use it",
            errno.errorcode.get(err, str(err)),
        )
        return False
    _installed = True
    return True
