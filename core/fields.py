"""The store's text rule as pydantic types, for every API that hands text to a store (SPEC, "One text rule").

``Text`` is ``validate.text`` (no NUL, no lone surrogate), with the bound each
field states (``Field(max_length=…)``, which the OpenAPI schema shows); ``Document``
is ``validate.document`` (valid Unicode throughout, bounded size and depth, no
credential-like key). A model's field of either type is refused
with 422 naming the field (pydantic's ``loc``) before anything reaches a store, by
the very check the store makes, so nothing stored can fail when it is read back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from pydantic import AfterValidator, ValidationInfo

from core import validate
from core.errors import InvalidInput


def _rule(check: Callable[[str, Any], object]) -> AfterValidator:
    def checked(value: Any, info: ValidationInfo) -> Any:
        try:
            check(info.field_name or "value", value)
        except InvalidInput as err:
            raise ValueError(err.problem) from None  # pydantic names the field (its loc)
        return value

    return AfterValidator(checked)


# every field of these types states its bound too (``Field(max_length=…)``); a test holds each to one
Text = Annotated[str, _rule(validate.text)]
Document = Annotated[dict[str, Any], _rule(validate.document)]
