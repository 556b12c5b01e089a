"""``gpuctl run``: an ad-hoc GPU job admitted under the same budget as the services.

- ``job``: the entry point, ``run()``: admission under the host's lock, CMD's start and
  record, its signals and exit, and the resumes after it;
- ``place``: a ``--wait`` caller's place in the host's wait queue, and its naps;
- ``room``: ``--preempt``, making room for the job with ``ensure``'s machinery
  (``gpuctl.flows.ensure.preempt.make_room``) and keeping it promised until CMD starts.

Shared with ``ensure``: the admission lock (``gpuctl.flows.admission``), the look
(``gpuctl.flows.look``) and ``make_room``. This file imports nothing, so importing one
step never runs the others.
"""
