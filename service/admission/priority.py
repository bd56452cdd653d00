"""Heavy work's threads yield the CPU to the event loop: they run at a lower OS priority (a higher nice value).

The event loop answers every request; a DuckDB query, a spatial join or an index build on a worker thread that
shares its cores at equal priority doubles a search's latency on a two-core machine. Linux keeps a nice value per
thread, and raising one's own needs no privilege, so each heavy executor's threads raise theirs as they start
(`ThreadPoolExecutor(initializer=lower_priority)`). Elsewhere (or where it fails) nothing changes.
"""

from __future__ import annotations

import os
import threading

HEAVY_NICE = 10  # how much lower: under CFS a nice-10 thread gets about a tenth of a core a nice-0 thread wants
# A background database process (an index no request waits for): the lowest priority, about 1.5% of a core that
# nice-0 work wants. At nice 10 a 768-d pgvector build still took 0.2 of a core of two from the searches.
BACKGROUND_NICE = 19


def lower_priority() -> None:
    """Lower the calling thread's CPU priority by HEAVY_NICE (at most to 19)."""
    try:
        _renice(threading.get_native_id())
    except AttributeError:  # no native thread ids here: the thread keeps its priority
        pass


def lower_process_priority(pid: int) -> None:
    """Lower another process's CPU priority to BACKGROUND_NICE: one of the embedded PostgreSQL's (a backend
    building an index in the background). Where that fails (not ours, or no such process), nothing changes. It
    cannot be undone: a process's priority is lowered only for good.

    Where the kernel schedules sessions as groups (autogroup, on by default in many distributions' kernels), a nice
    value only ranks a process among its own session's, and each PostgreSQL backend leads a session of its own: a
    background index build at nice 10 took a whole core of two from the searches (docs/design/serving.md). So that
    group's nice value is lowered too."""
    nice = _renice(pid, BACKGROUND_NICE)
    if nice is None:
        return
    try:
        if os.getsid(pid) == pid:  # the only one in its group, unless it started children (PostgreSQL's do not)
            with open(f"/proc/{pid}/autogroup", "w") as group:
                group.write(str(nice))
    except OSError:  # no autogroups here, or not ours
        pass


def _renice(pid: int, to: int | None = None) -> int | None:
    """Raise a thread's or process's nice value to `to`, or by HEAVY_NICE (at most to 19), never lowering it; the
    new value, or None where that failed."""
    try:
        now = os.getpriority(os.PRIO_PROCESS, pid)
        nice = max(now, to) if to is not None else min(19, now + HEAVY_NICE)
        os.setpriority(os.PRIO_PROCESS, pid, nice)
        return nice
    except OSError:
        return None
