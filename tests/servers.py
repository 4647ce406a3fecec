"""Spawn Crucible services as real subprocesses on free ports for tests (`crucible_cli.spawn`)."""

from crucible_cli.spawn import Service, free_port, spawn

__all__ = ["Service", "free_port", "spawn"]
