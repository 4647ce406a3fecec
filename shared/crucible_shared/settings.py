"""Settings helpers every service shares (each service has its own pydantic-settings `Settings`)."""

from __future__ import annotations

PLACEHOLDERS = frozenset({"changeme", "change-me", "change-me-please", "secret", "password", "test"})


def split_csv(value: object) -> object:
    """`"a, b"` from the environment -> `["a", "b"]` (lists pass through).

    >>> split_csv("k1, k2,,")
    ['k1', 'k2']
    """
    if isinstance(value, str):
        return [item.strip() for item in value.split(",") if item.strip()]
    return value


def check_api_keys(keys: list[str]) -> None:
    """Refuse short or placeholder API keys: a guessable key is worse than none (it looks secure).

    >>> check_api_keys(["0123456789abcdef"])
    >>> check_api_keys(["changeme"])
    Traceback (most recent call last):
    ...
    ValueError: api_keys: every key must be at least 16 characters and not a placeholder
    """
    if any(len(k) < 16 or k.lower() in PLACEHOLDERS for k in keys):
        raise ValueError("api_keys: every key must be at least 16 characters and not a placeholder")
