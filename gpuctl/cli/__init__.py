"""Typer commands: parse, call one flow, render. No decisions here (DESIGN §2)."""
