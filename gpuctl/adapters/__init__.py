"""I/O: GPU probes, process info, the agent client, health checks, the state store, launchers."""
