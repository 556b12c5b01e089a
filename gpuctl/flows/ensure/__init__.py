"""``ensure``: make a service ready, starting it only when that is safe, exactly once.

- ``rounds``: the entry point, ``ensure()``, and its rounds (look, decide, act);
- ``context``: one call's context (deadline, notes, results), shared by every step;
- ``launch``: the launch under the admission lease, where exactly-once is decided;
- ``wake``: a sleeping vLLM server woken under its lease;
- ``preempt``: making room by stopping lower-priority work (``make_room``, for ``run``
  too) and starting the service in it.

Shared with ``gpuctl run``: the admission lock (``gpuctl.flows.admission``) and
``preempt.make_room``. This file imports nothing, so importing one step never runs the
others (and no step can import its way back round to itself).
"""
