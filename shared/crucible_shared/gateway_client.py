"""Client of the gateway's job API (sync; used by the CLI, the demo and tests). Answers are the
typed models of `crucible_shared.gateway_protocol`; errors raise `GatewayError` with the envelope's
message and field."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx

from crucible_shared import sse
from crucible_shared.gateway_protocol import ArtifactList, JobCreated, JobList
from crucible_shared.lifecycle import JobRecord, JobStatus

RECONNECTS = 5  # times an event stream cut off midway is resumed before giving up


class GatewayError(Exception):
    def __init__(self, status: int, body: Any) -> None:
        error = body.get("error", {}) if isinstance(body, dict) else {}
        field = f" ({error['field']})" if error.get("field") else ""
        super().__init__(f"{status}: {error.get('message') or body}{field}")
        self.status, self.body = status, body


class GatewayUnreachable(GatewayError):
    """No answer from the gateway (connection refused, timeout)."""

    def __init__(self, url: str, exc: Exception) -> None:
        Exception.__init__(self, f"cannot reach the gateway at {url}: {exc}")
        self.status, self.body = 0, None


class GatewayClient:
    def __init__(self, url: str, api_key: str | None = None, timeout: float = 30.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.url = url.rstrip("/")
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> GatewayClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check(self, r: httpx.Response) -> Any:
        if r.status_code >= 400:
            try:
                body = r.json()
            except ValueError:
                body = r.text
            raise GatewayError(r.status_code, body)
        return r.json()

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            return self._check(self.http.request(method, path, **kwargs))
        except httpx.TransportError as exc:
            raise GatewayUnreachable(self.url, exc) from None

    def submit(self, spec: dict[str, Any], idempotency_key: str | None = None) -> JobCreated:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return JobCreated.model_validate(self._call("POST", "/v1/jobs", json=spec, headers=headers))

    def job(self, job_id: str) -> JobRecord:
        return JobRecord.model_validate(self._call("GET", f"/v1/jobs/{job_id}"))

    def jobs(
        self, status: JobStatus | str | None = None, kind: str | None = None, limit: int = 50
    ) -> JobList:
        params = {k: v for k, v in {"status": status, "kind": kind, "limit": limit}.items() if v is not None}
        return JobList.model_validate(self._call("GET", "/v1/jobs", params=params))

    def cancel(self, job_id: str) -> JobRecord:
        return JobRecord.model_validate(self._call("POST", f"/v1/jobs/{job_id}/cancel"))

    def retry(self, job_id: str) -> JobRecord:
        return JobRecord.model_validate(self._call("POST", f"/v1/jobs/{job_id}/retry"))

    def artifacts(self, job_id: str) -> ArtifactList:
        return ArtifactList.model_validate(self._call("GET", f"/v1/jobs/{job_id}/artifacts"))

    def download(self, job_id: str, path: str) -> bytes:
        """The bytes of one artifact (a path from `artifacts`)."""
        try:
            r = self.http.get(f"/v1/jobs/{job_id}/artifacts/{path}")
        except httpx.TransportError as exc:
            raise GatewayUnreachable(self.url, exc) from None
        if r.status_code >= 400:
            self._check(r)
        return r.content

    def events(
        self, job_id: str, last_event_id: str | None = None, timeout: float | None = None
    ) -> Iterator[tuple[str | None, str, dict[str, Any]]]:
        """Yield (id, event, data) from the job's SSE stream until it ends. A stream cut off
        midway is resumed from the last event seen (Last-Event-ID), a few times."""
        attempts, seen = 0, False
        while True:
            headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
            try:
                for event_id, event, data in self._events(job_id, headers, timeout):
                    seen = True
                    if event_id:
                        last_event_id, attempts = event_id, 0
                    yield event_id, event, data
                return
            except httpx.TransportError as exc:
                attempts += 1
                if not seen or attempts > RECONNECTS:  # never connected, or gone for good
                    raise GatewayUnreachable(self.url, exc) from None
                time.sleep(min(8.0, 0.5 * 2**attempts))

    def _events(
        self, job_id: str, headers: dict[str, str], timeout: float | None
    ) -> Iterator[tuple[str | None, str, dict[str, Any]]]:
        with self.http.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers, timeout=timeout) as r:
            if r.status_code >= 400:
                r.read()
                self._check(r)
            event_id: str | None = None
            event, data = "message", list[str]()
            for line in sse.lines(r.iter_bytes()):  # not iter_lines: see sse.py
                if not line:
                    if data:
                        payload = "\n".join(data)
                        try:
                            parsed = json.loads(payload)
                        except ValueError:
                            parsed = {"raw": payload}
                        yield event_id, event, parsed
                        if event == "end":
                            return
                    event_id, event, data = None, "message", []
                    continue
                if line.startswith(":"):
                    continue
                name, _, value = line.partition(":")
                value = value[1:] if value.startswith(" ") else value
                if name == "id":
                    event_id = value
                elif name == "event":
                    event = value
                elif name == "data":
                    data.append(value)
