"""What every API's bodies share: the strict request base, the response base, and the ``speculative``
extension object every answer carries."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from ...core.sampling import MIN_TEMP

Text = Annotated[str, Field(min_length=1)]


def _greedy_or_hot_enough(value: float) -> float:
    if 0 < value < MIN_TEMP:
        raise PydanticCustomError(
            "temperature_too_small",
            f"must be 0 (greedy) or at least {MIN_TEMP:g} (below it "
            "1/temperature overflows the float32 logits), got {value}",
            {"value": value},
        )
    return value


#: A sampling temperature (its upper bound is each API's): 0 is greedy; values in (0, 1e-6) are refused.
Temperature = Annotated[float, Field(ge=0), AfterValidator(_greedy_or_hot_enough)]


def is_none(value) -> bool:
    return value is None


def omitted():
    """A response field left out of the JSON while it is ``None`` (OpenAI and Anthropic omit such fields)."""
    return Field(None, exclude_if=is_none)


class ApiModel(BaseModel):
    """A request body: validated strictly (no type coercion, no NaN or infinity), unknown fields ignored, a
    field sent as ``null`` read as left out (clients that send every field, the unset ones as null, as the
    OpenAI and Anthropic APIs take them)."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_left_out(cls, data):
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class Reply(BaseModel):
    """A response body, built by the server."""

    model_config = ConfigDict(extra="forbid")


class Speculative(Reply):
    """The speculation stats of one answer (mlxspec's extension object, ``speculative``)."""

    drafter: str = Field(description="the drafter's name (`none`: plain decoding)")
    gamma: int | None = Field(
        description="γ, draft tokens per round (with `auto`: the most); null when nothing was drafted"
    )
    gamma_mean: float | None = Field(
        description="mean γ over the rounds (with `auto`); else, or when nothing was drafted, null"
    )
    rounds: int = Field(description="verify rounds")
    drafted: int = Field(description="draft tokens proposed")
    accepted: int = Field(description="draft tokens the target accepted")
    alpha: float = Field(description="accepted / drafted")
    tau: float = Field(description="tokens committed per round")
    per_position: list[float] = Field(description="acceptance per draft position or tree depth")
    prefill_s: float = Field(description="seconds of prompt prefill")
    decode_tokens_per_s: float = Field(description="generated tokens per second of decoding")
