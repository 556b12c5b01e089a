"""Typer commands: parse, call one flow, render. No decisions here (README: Development)."""
