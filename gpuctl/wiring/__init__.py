"""The composition root: builds the real adapters (store, agent client, probes,
launchers) into the ports each flow takes, for the CLI, the Python API and the proxy.

- ``build``: a service's ``EnsureDeps`` and the hosts ``status`` and ``locks`` ask;
- ``launchers``: the launcher a service's config names;
- ``reclaim``: ``gpuctl reclaim``'s deps, and the resumes after it;
- ``run``: ``gpuctl run``'s deps.

Flows never import it (they take what it builds as arguments); it sits above them.
"""
