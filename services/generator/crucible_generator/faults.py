"""Non-finite model outputs: a server fault, answered as one, never a number for the JSON encoder.

Log-probabilities are the log-softmax (float32) of the raw logits, so the sampled token's is NaN
exactly when its row of logits held a NaN or +inf. Nothing a client sends can cause that with
finite weights: it is a server fault. The engine checks every sampled token on the host (the value
is read back anyway); a sequence that hits one fails its whole request with a `ServerError` (500,
vLLM's `InternalServerError` envelope) whose message says what happened and names the request,
and the log gets the request's details. In a continuous batch the row's key/value cache blocks
are also zeroed once no row holds them: a NaN left there poisons every later sequence placed in
them, even through the attention mask (a masked slot's weight is 0, and 0 * NaN is NaN), so every retry of a request
landing in that row would fail again (what issue 24's H100 runs showed: six retries, six failures).

A log-probability of -inf is not a fault: a token of probability 0 in float32 (vLLM 0.22 computes
raw log-probs the same way, `logits.log_softmax(dim=-1, dtype=torch.float32)`, and its OpenAI
layer sends `max(logprob, -9999.0)`, JSON having no infinities). The API clamps it the same way.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from .errors import ServerError

log = logging.getLogger(__name__)

LOGPROB_FLOOR = -9999.0  # what vLLM sends instead of -inf


def is_fault(logprob: float) -> bool:
    """NaN or +inf: the row's logits were not finite (-inf is a token of probability 0).

    >>> [is_fault(x) for x in (-1.5, float("-inf"), float("nan"), float("inf"))]
    [False, False, True, True]
    """
    return math.isnan(logprob) or logprob == math.inf


def for_json(logprob: float) -> float:
    """A log-probability as the API sends it: -inf as -9999.0, like vLLM; a non-finite one (which
    the engine should have failed already) raises a `ServerError` instead of reaching the encoder.

    >>> for_json(-0.25), for_json(float("-inf"))
    (-0.25, -9999.0)
    """
    if is_fault(logprob):
        raise ServerError(
            f"The model produced a non-finite log-probability ({logprob}); this is a server fault."
        )
    return max(logprob, LOGPROB_FLOOR)


def non_finite(request_id: int, details: dict[str, Any], value: float) -> ServerError:
    """Log a sequence whose sampled token had a non-finite log-probability; the error for its request."""
    log.error(
        "request %d: non-finite log-probability %s (the logits of its row were not finite); %s",
        request_id,
        value,
        ", ".join(f"{k}={v}" for k, v in details.items()),
    )
    return ServerError(
        f"Generation failed: the model's logits for request {request_id} (sample {details.get('sample')}, "
        f"token {details.get('token')}) were not finite (log-probability {value}). This is a server "
        "fault, not a problem with the request; it is logged with the request's details and the "
        "server cleared the state involved, so a retry can succeed."
    )
