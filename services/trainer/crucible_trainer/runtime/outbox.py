"""A run's writes to Redis: fenced by its lease, and kept while Redis is away.

Every write a running job makes to its record and event stream (events, the latest progress,
the heartbeat) goes through one `Outbox`. Writes wait in memory, in order, and are delivered by
one Lua script that first checks the fence: the record is `running` and still holds this run's
lease (`crucible_shared.lifecycle`). So:

* while Redis is unreachable nothing is lost: events pile up (up to `limit`, the oldest dropped
  beyond it and the gap reported) and are delivered in order when it answers again, by the next
  event or the heartbeat thread;
* a delivery is exactly-once: each event carries its sequence number within the run and the
  script skips those the record says were delivered (a retry after a lost reply adds nothing);
* a run whose job was taken from it (re-queued by the reaper, started again elsewhere) is
  *fenced*: its delivery is refused, it drops what it holds and the job loop stops
  (`superseded`), writing nothing more.

The heartbeat is stamped with Redis's own clock (`TIME`), the one the gateway's reaper reads, so
the two agree on how long a job has been silent whatever the hosts' clocks say. Every accepted
delivery stamps it and renews the run's lease: `confirmed_at` is the (monotonic) time the last
accepted delivery was *sent*, so the reaper's view of the heartbeat is never older than it and a
lease counted from it lapses on this host before the reaper can take the job (`channel.gate`).
`commit` sets record fields (the checkpoint pointer) atomically with the fence check.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from typing import Any

from crucible_shared import keys
from crucible_shared.lifecycle import encode, encode_fields
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

# KEYS[1] the record, KEYS[2] the event stream. ARGV: lease, stream maxlen, beat (unused: every
# delivery stamps heartbeat_at with Redis TIME, since each one renews the lease), the number of progress field/value pairs, the first event's
# sequence number, then the pairs, then the events' data. Returns "ok", or "fenced:<status>".
_DELIVER = """
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'running' or redis.call('HGET', KEYS[1], 'lease') ~= ARGV[1] then
  return 'fenced:' .. tostring(status)
end
local npairs = tonumber(ARGV[4])
for i = 6, 5 + 2 * npairs, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
local done = tonumber(redis.call('HGET', KEYS[1], 'delivered') or '0') or 0
local first = tonumber(ARGV[5])
local last = done
for i = 6 + 2 * npairs, #ARGV do
  local seq = first + i - (6 + 2 * npairs)
  if seq > done then
    redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', 'data', ARGV[i])
    last = seq
  end
end
if last > done then redis.call('HSET', KEYS[1], 'delivered', tostring(last)) end
local t = redis.call('TIME')
redis.call('HSET', KEYS[1], 'heartbeat_at', string.format('%d.%06d', t[1], t[2]))
return 'ok'
"""
_BATCH = 200  # events per script call: a long outage's backlog goes in bounded pieces


class Outbox:
    """The ordered, fenced writes of one run of a job (thread-safe)."""

    def __init__(
        self, redis: Any, job_id: str, lease: str, *, limit: int = 10_000, maxlen: int = 10_000
    ) -> None:
        self.redis, self.job_id, self.lease = redis, job_id, encode("lease", lease)
        self.limit, self.maxlen = limit, maxlen
        self._events: deque[tuple[int, str]] = deque()  # (sequence number, JSON data)
        self._progress: dict[str, str] = {}
        self._next_seq = 1
        self._gap: tuple[int, int] | None = None  # (number of the last dropped event, how many)
        self._state = threading.Lock()  # guards the queues (held briefly)
        self._sending = threading.Lock()  # one delivery at a time, in order
        self.fenced: str | None = None  # the job's status when this run found it taken
        self.down_since: float | None = None  # when Redis last stopped answering (None: it answers)
        self.confirmed_at = time.monotonic()  # when the last delivery Redis accepted was sent

    # -- what the run writes --------------------------------------------------------------------
    def event(self, record: dict[str, Any] | str) -> None:
        """Queue an event: a record, or the JSON of one recorded earlier (sent as it was)."""
        data = record if isinstance(record, str) else json.dumps(record, default=str)
        with self._state:
            if self.fenced is not None:
                return
            self._events.append((self._next_seq, data))
            self._next_seq += 1
            while len(self._events) > self.limit:
                # The oldest go; one note in their place (their last number) says how many.
                seq, _ = self._events.popleft()
                self._gap = (seq, self._gap[1] + 1 if self._gap else 1)

    def progress(self, fields: dict[str, Any]) -> None:
        with self._state:
            if self.fenced is None:
                self._progress.update(encode_fields(fields))

    @property
    def pending(self) -> int:
        return len(self._events)

    def waiting(self, after: int = 0) -> list[tuple[int, str]]:
        """The events not yet delivered whose sequence number is over `after`, in order."""
        with self._state:
            out = []
            for seq, data in reversed(self._events):
                if seq <= after:
                    break
                out.append((seq, data))
        return out[::-1]

    # -- delivery ------------------------------------------------------------------------------
    def deliver(self, beat: bool = False) -> bool:
        """Send what waits (and a heartbeat); True when all of it reached Redis."""
        with self._sending:
            while True:
                with self._state:
                    if self.fenced is not None:
                        return False
                    gap = self._gap
                    batch = [self._gap_note(*gap)] if gap else []
                    batch += [self._events[i] for i in range(min(_BATCH, len(self._events)))]
                    progress = dict(self._progress)
                if not batch and not progress and not beat:
                    return True
                first = batch[0][0] if batch else self._next_seq
                pairs = [x for k, v in progress.items() for x in (k, v)]
                args = [self.lease, self.maxlen, "1" if beat else "0", len(progress), first, *pairs]
                sent_at = time.monotonic()
                try:
                    reply = self.redis.eval(
                        _DELIVER, 2, keys.job(self.job_id), keys.events(self.job_id),
                        *args, *(data for _, data in batch),
                    )  # fmt: skip
                except RedisError as exc:
                    if self.down_since is None:
                        self.down_since = time.time()
                        log.warning("job %s: Redis unreachable (%r); keeping its events", self.job_id, exc)
                    return False
                text = reply.decode() if isinstance(reply, bytes) else str(reply)
                with self._state:
                    if text == "ok":
                        self.confirmed_at = max(self.confirmed_at, sent_at)
                    if text != "ok":
                        self.fenced = text.split(":", 1)[1]
                        self._events.clear()
                        self._progress.clear()
                        self._gap = None
                        log.warning(
                            "job %s: this run no longer holds the job (it is %s); stopping without "
                            "writing", self.job_id, self.fenced,
                        )  # fmt: skip
                        return False
                    # By number: events dropped meanwhile (over the limit) moved the front.
                    sent = batch[-1][0] if batch else 0
                    while self._events and self._events[0][0] <= sent:
                        self._events.popleft()
                    if gap and self._gap == gap:
                        self._gap = None
                    for key, value in progress.items():
                        if self._progress.get(key) == value:
                            del self._progress[key]
                if self.down_since is not None:
                    log.warning(
                        "job %s: Redis answers again after %.0f s", self.job_id, time.time() - self.down_since
                    )
                    self.down_since = None
                beat = False

    def commit(self, fields: dict[str, Any]) -> bool | None:
        """Set record fields only while this run holds the job (one script call, fenced like every
        delivery): True when set, False when fenced, None when Redis did not answer."""
        with self._state:
            if self.fenced is not None:
                return False
        pairs = [x for k, v in encode_fields(fields).items() for x in (k, v)]
        sent_at = time.monotonic()
        try:
            reply = self.redis.eval(
                _DELIVER, 2, keys.job(self.job_id), keys.events(self.job_id),
                self.lease, self.maxlen, "1", len(fields), self._next_seq, *pairs,
            )  # fmt: skip
        except RedisError as exc:
            log.warning("job %s: commit of %s waits for Redis (%r)", self.job_id, sorted(fields), exc)
            return None
        text = reply.decode() if isinstance(reply, bytes) else str(reply)
        with self._state:
            if text == "ok":
                self.confirmed_at = max(self.confirmed_at, sent_at)
                return True
            self.fenced = text.split(":", 1)[1]
            self._events.clear()
            self._progress.clear()
        log.warning("job %s: this run no longer holds the job (it is %s)", self.job_id, self.fenced)
        return False

    def drain(self, wait_s: float, poll_s: float = 1.0) -> bool:
        """Deliver everything, waiting up to `wait_s` for Redis to come back; False if fenced or
        Redis stayed away."""
        deadline = time.monotonic() + wait_s
        while not self.deliver():
            if self.fenced is not None or time.monotonic() > deadline:
                return False
            time.sleep(poll_s)
        return True

    @staticmethod
    def _gap_note(seq: int, count: int) -> tuple[int, str]:
        message = f"{count} events were dropped while Redis was unreachable"
        note = {"type": "notice", "time": time.time(), "message": message}  # crucible_shared.events
        return seq, json.dumps(note)
