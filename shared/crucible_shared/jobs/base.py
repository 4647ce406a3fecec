"""What every spec section shares: forbidden extra fields, finite floats, the `_changed` check and
the errors that name their field (the gateway reports it)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import PydanticCustomError

MAX_SEED = 2**63 - 1
MAX_STEPS = 1_000_000
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    def _changed(self, name: str) -> bool:
        """Whether `name` differs from its default. (Not "was given": a spec dumped with its
        defaults and parsed again, as every queued job is, must still be valid.)"""
        field = type(self).model_fields[name]
        return getattr(self, name) != field.get_default(call_default_factory=True)


def unused(field: str, reason: str) -> PydanticCustomError:
    """The error for a field that would be silently ignored; `field` is the dotted path from the
    model being validated (the gateway reports it as the error's field)."""
    return PydanticCustomError("unused_field", "{field}: {reason}", {"field": field, "reason": reason})


def invalid(field: str, reason: str) -> PydanticCustomError:
    """A cross-field error that names its field as `unused` does (for the gateway's envelope)."""
    return PydanticCustomError("value_error", "{field}: {reason}", {"field": field, "reason": reason})


_ATTEMPTS = Field(
    None,
    ge=1,
    le=10,
    description="Runs allowed when the worker running it is lost (resuming from the last checkpoint); "
    "default: the gateway's setting.",
)
