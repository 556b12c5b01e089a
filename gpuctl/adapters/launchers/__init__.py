"""Launchers: start a model server detached, find it again, tell if it lives, stop it.

Three implementations of ``base.Launcher``: ``process`` (a detached local command),
``docker`` (the Docker Engine API), ``jupyter`` (a named JupyterLab terminal).
"""
