"""This process's memory as Linux reports it in /proc/self: resident set, its peak, address space.

Shared by bench.py, memory_check.py and headline.py. The peak (VmHWM) can be reset to the current
RSS by writing 5 to /proc/self/clear_refs (Linux >= 4.0), so one process can measure one step after
another; where /proc cannot be read, the peak falls back to `ru_maxrss` (never reset).
"""

from __future__ import annotations

import resource
import time

MIB = 1 << 20


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def rss_bytes() -> int:
    """The resident set size now (VmRSS)."""
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """The peak resident set size since start or the last `reset_peak_rss()` (VmHWM)."""
    try:
        return _status_kib("VmHWM") * 1024
    except (OSError, KeyError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def address_space_bytes() -> int:
    """The virtual address space now (VmSize): the base of an RLIMIT_AS budget."""
    return _status_kib("VmSize") * 1024


def reset_peak_rss() -> bool:
    """Sets the peak RSS to the current RSS; False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def limit_address_space(budget_bytes: int) -> int:
    """Caps this process's address space (RLIMIT_AS) at its current size + `budget_bytes`.

    An allocation past the budget then fails with an error the caller can report (out of memory),
    instead of the process taking the machine down. Returns the limit set.
    """
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = address_space_bytes() + budget_bytes
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    return limit


def available_bytes() -> int:
    """The memory the kernel could give a new allocation (/proc/meminfo's MemAvailable; 0 elsewhere)."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def timed_call(call) -> tuple[float, int]:
    """Seconds and resident-set rise (bytes) of `call()`: one measurement of the benchmarks' loss steps."""
    reset_peak_rss()
    before = rss_bytes()
    start = time.perf_counter()
    call()
    seconds = time.perf_counter() - start
    return seconds, peak_rss_bytes() - before
