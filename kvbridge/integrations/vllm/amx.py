"""Ask Linux for the AMX tile state before vLLM's CPU attention may use it.

vLLM's CPU attention picks its AMX kernels (``cpu_attn._get_attn_isa``: bf16, block size a
multiple of 32) from the CPU's flags (``torch.cpu._is_amx_tile_supported``), and nothing on
that path asks the kernel for the AMX tile data state. Linux (5.16 and later) grants it to a
process only on request (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``); without
it the first tile load is an illegal instruction. A colocated vLLM is spared by accident: its
first forward is a prefill whose bf16 GEMMs go through oneDNN, which asks. A decode instance
of a disaggregated pair is not: its first forward over the KV it received is a one-token
decode step, and on a Sapphire Rapids host the engine's worker died with SIGILL inside
``cpu_attention_with_kv_cache`` (every vLLM test of a pair failed). The worker side of the
connector asks for the state when it is built, as oneDNN would; on a CPU without AMX, or a
kernel without the call, nothing happens.
"""

from __future__ import annotations

import ctypes
import logging
import platform
import sys

log = logging.getLogger(__name__)

_SYS_ARCH_PRCTL = 158  # x86-64
_ARCH_GET_XCOMP_PERM = 0x1022
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18
_X86_LINUX = sys.platform == "linux" and platform.machine() == "x86_64"


def amx_flags() -> bool:
    """Does the CPU advertise AMX tiles (/proc/cpuinfo's ``amx_tile``)?"""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return "amx_tile" in line.split()
    except OSError:
        return False
    return False


def _arch_prctl(code: int, arg: object) -> int:
    return ctypes.CDLL(None, use_errno=True).syscall(_SYS_ARCH_PRCTL, code, arg)


def amx_permitted() -> bool:
    """Has this process the AMX tile data state (bit 18 of ARCH_GET_XCOMP_PERM)?"""
    if not _X86_LINUX:
        return False
    mask = ctypes.c_uint64(0)
    return _arch_prctl(_ARCH_GET_XCOMP_PERM, ctypes.byref(mask)) == 0 and bool(mask.value >> _XFEATURE_XTILEDATA & 1)


def request_amx_state() -> bool:
    """Ask for the AMX tile data state where the CPU has AMX; True when this process holds it."""
    if not (_X86_LINUX and amx_flags()):
        return False
    if amx_permitted():
        return True
    if _arch_prctl(_ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) != 0:
        log.warning("kvbridge: the CPU has AMX but Linux refused its tile state (errno %d): vLLM's AMX "
                    "attention kernels may die with SIGILL", ctypes.get_errno())
        return False
    return amx_permitted()
