"""Tenants: whom an API key belongs to, what it may see, and how much it may take.

A tenant is a name, its keys, an `admin` flag and quotas. What a tenant submits (gateway jobs,
their events, artifacts and adapters; sandbox runs and their cached results) is its own: another
tenant is told it does not exist (404), an admin sees everything.

Configuration, per service (`<P>` is `CRUCIBLE_GATEWAY` or `CRUCIBLE_SANDBOX`):

* `<P>_TENANTS_FILE`: a JSON file, or `<P>_TENANTS`: the same JSON inline::

      {"tenants": [
        {"name": "research", "keys": ["...16+ chars..."], "admin": true},
        {"name": "ci", "keys": ["..."], "quotas": {"active_jobs": 4, "concurrent_runs": 8}}
      ]}

* `<P>_API_KEYS=k1,k2` (as before): each plain key is a tenant of its own, named
  `key-<first 8 hex digits of the key's SHA-256>`, with the service's default quotas. A key listed
  in both places belongs to the tenant the JSON names.

With no key at all, auth is off and every caller is the one admin tenant `anonymous`.

`TenantAuth` is the ASGI middleware both services put outermost: it maps the bearer key to its
tenant before a byte of the body is read, answers 401 otherwise, and leaves the tenant where any
route, present or added later, finds it: `request.state.tenant` (the dependency `current_tenant`).
Only the paths in `public` (health, metrics, the API docs) are served without a key.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator

from crucible_shared.settings import check_api_keys

try:  # FastAPI injects the request by this annotation; `crucible_shared` installs without it
    from starlette.requests import Request
except ImportError:  # pragma: no cover
    Request = Any  # type: ignore[misc,assignment]

TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")
PUBLIC_PATHS = frozenset({"/health", "/metrics", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})


class Quotas(BaseModel):
    """Per-tenant limits; a field left out takes the service's default (its settings)."""

    model_config = ConfigDict(extra="forbid")

    active_jobs: int | None = Field(None, ge=0, description="Gateway: queued + running jobs.")
    spec_bytes: int | None = Field(None, ge=1, description="Gateway: size of one job spec (JSON).")
    event_streams: int | None = Field(None, ge=0, description="Gateway: open event streams.")
    concurrent_runs: int | None = Field(None, ge=1, description="Sandbox: runs holding a worker.")
    queued_runs: int | None = Field(None, ge=0, description="Sandbox: runs admitted and not finished.")
    # Worker-seconds (each run's time holding a worker: wall time, which bounds its CPU time), not
    # CPU time: once named `cpu_seconds_per_minute`, a name still accepted.
    worker_seconds_per_minute: float | None = Field(
        None,
        gt=0,
        validation_alias=AliasChoices("worker_seconds_per_minute", "cpu_seconds_per_minute"),
        description="Sandbox: worker-seconds (time holding a worker) used over the last minute.",
    )


class Tenant(BaseModel):
    """Who a request comes from (never holds a key)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    admin: bool = False
    quotas: Quotas = Field(default_factory=Quotas)
    share_cache: bool = Field(
        False,
        description="Sandbox: cached results are shared with the other tenants that opt in (public "
        "datasets); otherwise a cache hit only ever answers the tenant whose run filled it.",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not TENANT_NAME.match(value):
            raise ValueError(
                "a tenant name is 1-64 letters, digits, `_`, `.`, `-`, starting with a letter or digit"
            )
        return value

    def sees(self, owner: str | None) -> bool:
        """Whether this tenant may see something owned by `owner` (None: made before tenants)."""
        return self.admin or owner == self.name


class _Entry(Tenant):
    keys: list[str] = Field(min_length=1)


class _File(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenants: list[_Entry]


ANONYMOUS = Tenant(name="anonymous", admin=True)


def _digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


def plain_key_tenant(key: str) -> str:
    """The tenant name of a key given in a plain key list.

    >>> plain_key_tenant("0123456789abcdef")
    'key-9f9f5111'
    """
    return f"key-{hashlib.sha256(key.encode()).hexdigest()[:8]}"


class TenantTable:
    """Keys -> tenants. Keys are kept only as SHA-256 digests, and a lookup hashes the offered
    token first, so the time it takes says nothing about how close a guess was."""

    def __init__(self, tenants: Iterable[tuple[Tenant, Iterable[str]]]) -> None:
        self.by_digest: dict[bytes, Tenant] = {}
        self.names: dict[str, Tenant] = {}
        for tenant, keys in tenants:
            if tenant.name in self.names:
                raise ValueError(f"tenants: {tenant.name!r} is named twice")
            self.names[tenant.name] = tenant
            for key in keys:
                self.by_digest[_digest(key)] = tenant

    @property
    def auth(self) -> bool:
        return bool(self.by_digest)

    @classmethod
    def load(
        cls, api_keys: list[str], file: Path | None = None, inline: str = "", env: str = ""
    ) -> TenantTable:
        """The table from a plain key list plus a tenants JSON (a file, or inline text).
        `ValueError` naming the setting for anything malformed."""
        entries: list[_Entry] = []
        for where, text in ((f"{env}_TENANTS_FILE", _read(file)), (f"{env}_TENANTS", inline)):
            if not text.strip():
                continue
            try:
                entries += _File.model_validate(json.loads(text)).tenants
            except (ValueError, ValidationError) as exc:
                raise ValueError(f"{where}: not a tenants document ({str(exc)[:300]})") from None
        named = {k for e in entries for k in e.keys}
        check_api_keys([*named, *api_keys])
        pairs: list[tuple[Tenant, Iterable[str]]] = [
            (Tenant.model_validate(e.model_dump(exclude={"keys"})), e.keys) for e in entries
        ]
        pairs += [(Tenant(name=plain_key_tenant(k)), [k]) for k in dict.fromkeys(api_keys) if k not in named]
        return cls(pairs)

    def lookup(self, header: str | None) -> Tenant:
        """The tenant of an `Authorization: Bearer` header; `ApiError` 401 without a valid key.
        With auth off, `ANONYMOUS`."""
        from crucible_shared.http import ApiError

        if not self.auth:
            return ANONYMOUS
        scheme, _, token = (header or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(
                401,
                "missing API key: send `Authorization: Bearer <key>`",
                headers={"WWW-Authenticate": "Bearer"},
            )
        tenant = self.by_digest.get(_digest(token.strip().encode("latin-1", "replace")))
        if tenant is None:
            raise ApiError(401, "invalid API key", headers={"WWW-Authenticate": "Bearer"})
        return tenant


def _read(file: Path | None) -> str:
    if file is None:
        return ""
    try:
        return Path(file).read_text()
    except OSError as exc:
        raise ValueError(f"tenants file {file}: {exc.strerror}") from None


class TenantAuth:
    """ASGI middleware: the caller's tenant, from its key, before the body is read (see the module
    docstring). A plain ASGI middleware, so it wraps every route, including ones added later."""

    def __init__(self, app: Any, table: TenantTable, public: frozenset[str] = PUBLIC_PATHS) -> None:
        self.app, self.table, self.public = app, table, public

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        from crucible_shared.http import ApiError, send_error

        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
        try:
            tenant: Tenant | None = self.table.lookup(header)
        except ApiError as exc:
            if scope["path"] not in self.public:
                await send_error(send, exc.status, exc.message, exc.field, exc.headers)
                return
            tenant = None
        scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)


def current_tenant(request: Request) -> Tenant:
    """The tenant `TenantAuth` found (a FastAPI dependency: `Depends(current_tenant)`)."""
    tenant = getattr(request.state, "tenant", None)
    if tenant is None:  # a public route: no key needed, none given
        from crucible_shared.http import ApiError

        raise ApiError(401, "missing API key: send `Authorization: Bearer <key>`")
    return tenant
