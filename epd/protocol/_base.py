"""Shared building blocks of the wire types: the base model and located validation errors.

Invariants:
- Every wire model derives from `_Wire`: unknown fields are ignored (as OpenAI does).
- `_fail` raises a `ValidationError` located at a parameter, so `epd.errors` renders it with
  an OpenAI `param`; `_unsupported` is the error for features refused on purpose (rendered
  with code `unsupported_value`).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

DTYPES = ("float32", "bfloat16", "float16")
KV_LAYOUT_KEYS = ("num_layers", "num_kv_heads", "head_dim", "dtype", "block_size")


def _fail(model: str, param: str, message: str, code: str = "value_error", value: Any = None):
    """Raise a validation error located at `param` (a model validator's errors have no loc)."""
    err = PydanticCustomError(code, "{msg}", {"msg": message})
    raise ValidationError.from_exception_data(
        model, [InitErrorDetails(type=err, loc=(param,), input=value)]
    )


def _unsupported(message: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported_value", "{msg}", {"msg": message})


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore")
