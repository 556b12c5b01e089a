"""Typer commands: parse, call one flow, render. No decisions here (CONTRIBUTING.md)."""
