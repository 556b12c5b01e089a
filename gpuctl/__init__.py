"""gpuctl: share one big GPU between heavy workloads.

Process-level status, safe on-demand starts behind leases, one shared truth of
last-used times on the GPU host, and reclaim from cron. See README.md.
"""

__version__ = "0.1.0"
