"""What every spec section shares: forbidden extra fields, finite floats, the `_changed` check and
the errors that name their field (the gateway reports it)."""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

MAX_SEED = 2**63 - 1
MAX_STEPS = 1_000_000
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _strict_ints(cls, data: Any) -> Any:
        """A count is a JSON integer: `true` is not 1 step and `"2"` is not 2 (pydantic's lax
        mode would take both). Floats with no fraction stay accepted, as JSON has one number."""
        if isinstance(data, dict):
            for name, field in cls.model_fields.items():
                value = data.get(name)
                if isinstance(value, bool | str) and _is_int_field(field.annotation):
                    if isinstance(value, str) and _allows_text(field.annotation, value):
                        continue
                    raise invalid(name, f"must be an integer, not {json.dumps(value)}")
        return data

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
    # It trains on a file, with TRL (no rollouts): the offline job runs it, not the online loop.
    offline: ClassVar[bool] = False

    def samples_per_step(self, problems_per_step: int) -> int:
        """Most samples a step draws (the method's sample budget per step)."""
        if self.per_problem is None:
            raise ValueError(f"{type(self).__name__} samples no completions per step")
        return int(getattr(self, self.per_problem)) * problems_per_step


def _is_int_field(annotation: Any) -> bool:
    """`int`, `int | None`, `int | Literal[...]`: a field whose numbers are integers."""
    if annotation is int:
        return True
    args = get_args(annotation)
    return int in args and float not in args and bool not in args


def _allows_text(annotation: Any, value: str) -> bool:
    """Whether the field also takes this text (`micro_batch: "auto"`, `ids: ["MBPP/11"]`)."""
    for arg in get_args(annotation):
        if arg is str or (get_origin(arg) is Literal and value in get_args(arg)):
            return True
    return False


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
