"""Crucible trainer: datasets and prompts, evaluation, and the online RL worker."""
