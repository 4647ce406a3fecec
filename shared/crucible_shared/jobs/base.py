"""What every spec section shares: forbidden extra fields, finite floats, the `_changed` check and
the errors that name their field (the gateway reports it)."""

from __future__ import annotations

from typing import Annotated, ClassVar

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


class _Method(_Spec):
    """What a method's config says about the method besides its fields: facts the train job's
    checks and the reports read from the class (no table keyed by method name elsewhere)."""

    # Its step samples groups of completions per prompt and carries nothing to the next step,
    # so its rollouts may overlap the update (jobs/overlap.py).
    samples_groups: ClassVar[bool] = False
    # The field holding its samples per problem (None: it samples no problems).
    per_problem: ClassVar[str | None] = None

    def samples_per_step(self, problems_per_step: int) -> int:
        """Most samples a step draws (the method's sample budget per step)."""
        if self.per_problem is None:
            raise ValueError(f"{type(self).__name__} samples no completions per step")
        return int(getattr(self, self.per_problem)) * problems_per_step


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
