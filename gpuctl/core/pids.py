"""The one bound on a pid, for every check that reads one off the wire or a driver.

Linux's ``PID_MAX_LIMIT`` on 64-bit hosts is 2**22: ``/proc/sys/kernel/pid_max`` can be
no more, and every pid is below ``pid_max``. A larger figure is garbage (a struct read
with the wrong layout, a forged record), never a process.
"""

from __future__ import annotations

from typing import Final

PID_MAX: Final = 1 << 22
