"""Rendering: Rich views and versioned JSON objects. Rich is imported here only."""
