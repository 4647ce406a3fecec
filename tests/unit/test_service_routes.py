"""Every service's routes and error handlers are module-level functions of router modules
(`crucible_gateway.routes`, `crucible_sandbox.server.routes` and `.fusion`,
`crucible_generator.routes`), never closures made inside `create_app`: a newcomer finds a route
by its module, and a test can import it."""

from __future__ import annotations

import pytest
from fastapi.routing import APIRoute


def _apps():
    from crucible_gateway.api import create_app as gateway
    from crucible_generator.api import create_app as generator
    from crucible_sandbox.server.api import create_app as sandbox

    return {"gateway": gateway, "sandbox": sandbox, "generator": generator}


def _api_routes(routes) -> list[APIRoute]:
    """The app's routes, through included routers (FastAPI may keep them as one entry each)."""
    out = []
    for route in routes:
        inner = getattr(route, "original_router", None)
        if inner is not None:
            out += _api_routes(inner.routes)
        elif isinstance(route, APIRoute):
            out.append(route)
    return out


@pytest.mark.parametrize("name", ["gateway", "sandbox", "generator"])
def test_routes_and_handlers_are_not_closures(name: str) -> None:
    app = _apps()[name]()
    routes = _api_routes(app.routes)
    assert {r.path_format for r in routes} == set(app.openapi()["paths"])
    for route in routes:
        where = f"{route.endpoint.__module__}.{route.endpoint.__qualname__}"
        assert "<locals>" not in where, f"{route.path} is served by a closure: {where}"
        assert route.endpoint.__module__.rsplit(".", 1)[-1] in (
            "routes",
            "fusion",
            "jobs",
            "events",
            "artifacts",
            "ops",
        ), where
    for exc, handler in app.exception_handlers.items():
        assert "<locals>" not in handler.__qualname__, f"the handler of {exc} is a closure"
