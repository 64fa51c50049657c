"""The base every config section shares: a pydantic model that refuses unknown keys and checks
every assignment, and the validator that lets a name-valued field (``dataset.name``,
``partition.scheme``, ``model.name``) take a plugin's name beside the built-ins its ``Literal``
spells out.
"""

from __future__ import annotations

from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import PydanticCustomError

from flockfl import plugins


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _or_plugin(kind: str, section: type[BaseModel], value: Any, handler: Any, field: str) -> Any:
    """A name the field's Literal spells out (flockfl's built-ins), or one a plugin registered
    (``flockfl.plugins``: entry points, ``FLOCKFL_PLUGINS``), loaded at the first name that is
    not a built-in. An unknown name is the Literal's error, the plugins' names listed too."""
    try:
        return handler(value)
    except ValidationError as err:
        if not isinstance(value, str) or err.errors()[0]["type"] != "literal_error":
            raise
        extra = plugins.names(kind)
        if value in extra:
            return value
        known = [repr(n) for n in (*get_args(section.model_fields[field].annotation), *extra)]
        raise PydanticCustomError("literal_error", "Input should be {expected} (a plugin's name needs its plugin: "
                                  f"{plugins.ENV}=module or an installed package, docs/plugins.md)",
                                  {"expected": ", ".join(known[:-1]) + " or " + known[-1]}) from None
