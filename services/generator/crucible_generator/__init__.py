"""Crucible generator service."""
