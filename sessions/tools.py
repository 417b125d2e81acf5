"""Function tools and ``tool_choice`` as the engine takes them, with the checks both APIs share.

The realtime session keeps tools in their wire shape (echoed in ``session.updated``) and turns them
into :class:`~omnirt.stages.types.ToolSpec` per response; chat completions does the same per
request. Both refuse what the engine could not honour before anything runs: a parameters schema
that is not a valid JSON Schema, duplicate names, a ``tool_choice`` that names a function that is
not among the tools, or ``required`` without any tool.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import jsonschema
from omnirt.stages.types import NamedTool, ToolChoice, ToolSpec

from .errors import ErrorCode, SessionError

#: OpenAI's rule for function (and response format) names.
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
_NAME = re.compile(NAME_PATTERN)
#: What a function without ``parameters`` takes: an object with no fields.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class ToolError(ValueError):
    """A tool definition or ``tool_choice`` that cannot be honoured; ``field`` is where, relative to
    the object checked (``""``: the value itself), for the caller to prefix."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.field = field


#: A schema nested deeper than the meta-schema check can recurse (each level of a schema costs the
#: check several frames, so a body within the JSON parser's depth limit can still be too deep).
TOO_DEEP = "the JSON Schema is nested too deeply to be checked"


def check_schema(schema: object) -> None:
    """Raise :class:`ToolError` unless ``schema`` is a JSON Schema (an object valid against the
    meta-schema of its ``$schema``, draft 2020-12 when absent)."""
    if not isinstance(schema, Mapping):
        raise ToolError(f"a JSON Schema must be a JSON object, not {type(schema).__name__}")
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise ToolError(
            f"not a valid JSON Schema: {exc.message}" + (f" (at '{where}')" if where else "")
        ) from None
    except RecursionError:  # a body under the JSON parser's depth limit; the check recurses deeper
        raise ToolError(TOO_DEEP) from None


def check_name(name: str) -> None:
    """Raise :class:`ToolError` (``field`` ``name``) unless ``name`` matches :data:`NAME_PATTERN`."""
    if not _NAME.match(name):
        raise ToolError(f"{name!r} must be 1 to 64 letters, digits, underscores or dashes", "name")


def tool_spec(name: str, description: str | None, parameters: dict[str, Any] | None) -> ToolSpec:
    """One function tool, checked: ``name`` per :data:`NAME_PATTERN`, ``parameters`` a JSON Schema
    (absent: no arguments)."""
    check_name(name)
    if parameters is None:
        parameters = NO_PARAMETERS
    try:
        check_schema(parameters)
    except ToolError as exc:
        raise ToolError(exc.message, "parameters") from None
    return ToolSpec(name=name, description=description or "", parameters=dict(parameters))


def check_unique(tools: Iterable[ToolSpec]) -> None:
    """Raise :class:`ToolError` (``field`` the index of the second one) when two tools share a name."""
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.name in seen:
            raise ToolError(f"two tools are named {tool.name!r}; function names must be unique", str(i))
        seen.add(tool.name)


def resolve_choice(choice: str | None, named: str | None, tools: Iterable[ToolSpec] | None) -> ToolChoice:
    """``tool_choice`` for the engine: ``choice`` one of ``auto | none | required`` (``None``:
    ``auto``), or ``named`` the function the model must call. Raises :class:`ToolError` when the
    named function is not among ``tools``, or ``required`` comes without any tool; with ``tools``
    None (not known yet) only the choice itself is checked."""
    if tools is None:
        if named is not None:
            return NamedTool(named)
        if choice == "required":
            return "required"
    names = [t.name for t in tools or ()]
    if named is not None:
        if named not in names:
            listed = ", ".join(repr(n) for n in names) or "none"
            raise ToolError(
                f"tool_choice names the function {named!r}, which is not among the tools ({listed})"
            )
        return NamedTool(named)
    if choice == "required" and not names:
        raise ToolError("tool_choice 'required' needs at least one tool")
    if choice in (None, "auto"):
        return "auto"
    if choice in ("none", "required"):
        return choice  # type: ignore[return-value]
    raise ToolError(f"tool_choice must be 'auto', 'none', 'required' or name a function, not {choice!r}")


def realtime_tools(
    tools: list[dict[str, Any]], tool_choice: str | dict[str, Any], where: str, *, match: bool = True
) -> tuple[list[ToolSpec], ToolChoice]:
    """A realtime session's (or response's) ``tools`` and ``tool_choice``, in their wire shape
    (``{"type": "function", "name", "description", "parameters"}``; ``tool_choice`` a mode or
    ``{"type": "function", "name"}``), for the engine. Raises ``invalid_value`` naming the field
    under ``where`` (``session`` or ``response``). ``match=False`` checks each alone, not that the
    choice names one of the tools (a session's choice may come before its tools)."""
    specs: list[ToolSpec] = []
    try:
        for i, tool in enumerate(tools):
            try:
                specs.append(tool_spec(tool["name"], tool.get("description"), tool.get("parameters")))
            except ToolError as exc:
                raise ToolError(exc.message, f"{i}.{exc.field}") from None
        check_unique(specs)
    except ToolError as exc:
        param = f"{where}.tools.{exc.field}"
        raise SessionError(
            ErrorCode.INVALID_VALUE, f"Invalid value for '{param}': {exc.message}.", param
        ) from None
    named = tool_choice.get("name") if isinstance(tool_choice, dict) else None
    try:
        choice = resolve_choice(
            None if isinstance(tool_choice, dict) else tool_choice, named, specs if match else None
        )
    except ToolError as exc:
        param = f"{where}.tool_choice"
        raise SessionError(
            ErrorCode.INVALID_VALUE, f"Invalid value for '{param}': {exc.message}.", param
        ) from None
    return specs, choice
