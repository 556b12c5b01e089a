"""The guided tour (``gpuctl demo``): a script over a throw-away simulated host
(``gpuctl.sim.host``) and the real wiring, in chapters (``tour``, ``chapters``,
``priority``)."""
