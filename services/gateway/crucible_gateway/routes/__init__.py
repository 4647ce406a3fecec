"""The gateway's HTTP routes, one module per concern; `api.create_app` includes them in this order.

Routes stay thin: each reads the `GatewayService` the app holds (`deps.service`) and leaves the
logic to it. The order matters only for matching and for the OpenAPI listing, and is the order of
`ROUTERS`.
"""

from __future__ import annotations

from crucible_gateway.routes import artifacts, events, jobs, ops

ROUTERS = (jobs.router, events.router, artifacts.router, ops.router)
