"""GPU probes: NVML (``nvidia-ml-py``), ``nvidia-smi`` CSV, and the simulated GPU.

Each probe is a callable object with ``read() -> ProbeReading``; see ``base.Probe``.
Imports of ``pynvml`` happen inside the NVML probe only.
"""
