"""Crucible sandbox service: executes untrusted, model-written Python against tests."""
