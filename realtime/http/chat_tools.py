"""Chat completions' ``tools``, ``tool_choice`` and ``response_format`` for the engine.

Function tools become :class:`ToolSpec` (names and parameter schemas checked), ``tool_choice``
``auto | none | required``, a named function (:class:`NamedTool`) or ``allowed_tools`` (the tools
passed on are then only the allowed ones, with its mode); ``response_format`` ``json_schema``
becomes a :class:`JsonSchemaFormat` of its schema, ``json_object`` one of ``{"type": "object"}``.
Everything the engine could not honour is a 400 naming the parameter.
"""

from __future__ import annotations

from omnirt.sessions.tools import ToolError, check_name, check_schema, check_unique, resolve_choice, tool_spec
from omnirt.stages.types import JsonSchemaFormat, ToolChoice, ToolSpec

from .chat_schema import (
    AllowedToolsChoice,
    ChatCompletionRequest,
    CustomTool,
    CustomToolChoice,
    FunctionTool,
    JsonObjectResponseFormat,
    JsonSchemaResponseFormat,
    NamedToolChoice,
)
from .errors import APIError, bad_request

#: What ``json_object`` asks for: one JSON object.
JSON_OBJECT: dict[str, object] = {"type": "object"}


def _invalid(param: str, message: str) -> APIError:
    return bad_request(f"Invalid value for '{param}': {message}.", param=param)


def engine_tools(req: ChatCompletionRequest) -> tuple[list[ToolSpec], ToolChoice]:
    """The request's tools and tool choice as the engine takes them."""
    if req.functions is not None or req.function_call is not None:
        param = "functions" if req.functions is not None else "function_call"
        raise bad_request(
            f"'{param}' (legacy function calling) is not supported; declare the functions in "
            "'tools' (type 'function') and choose with 'tool_choice'.",
            param=param,
        )
    specs: list[ToolSpec] = []
    for i, tool in enumerate(req.tools or []):
        if isinstance(tool, CustomTool):
            raise bad_request(
                "Custom tools are not supported by this server; only tools of type 'function'.",
                param=f"tools[{i}].type",
            )
        assert isinstance(tool, FunctionTool)
        f = tool.function
        try:
            specs.append(tool_spec(f.name, f.description, f.parameters))
        except ToolError as exc:
            raise _invalid(f"tools[{i}].function.{exc.field}", exc.message) from None
    try:
        check_unique(specs)
    except ToolError as exc:
        raise _invalid(f"tools[{exc.field}].function.name", exc.message) from None
    return _choice(req, specs)


def _choice(req: ChatCompletionRequest, specs: list[ToolSpec]) -> tuple[list[ToolSpec], ToolChoice]:
    choice = req.tool_choice
    if isinstance(choice, CustomToolChoice):
        raise bad_request("Custom tools are not supported by this server.", param="tool_choice.type")
    if isinstance(choice, AllowedToolsChoice):
        names = {t.name for t in specs}
        allowed: list[str] = []
        for i, entry in enumerate(choice.allowed_tools.tools):
            if entry.function.name not in names:
                raise _invalid(
                    f"tool_choice.allowed_tools.tools[{i}].function.name",
                    f"{entry.function.name!r} is not among the tools",
                )
            allowed.append(entry.function.name)
        specs = [t for t in specs if t.name in allowed]
        mode = choice.allowed_tools.mode
        return specs, resolve_choice(mode, None, specs)
    try:
        if isinstance(choice, NamedToolChoice):
            return specs, resolve_choice(None, choice.function.name, specs)
        return specs, resolve_choice(choice, None, specs)
    except ToolError as exc:
        raise _invalid("tool_choice", exc.message) from None


def engine_format(req: ChatCompletionRequest) -> JsonSchemaFormat | None:
    """``response_format`` as a constraint on the reply text (``None`` for plain text)."""
    fmt = req.response_format
    if isinstance(fmt, JsonObjectResponseFormat):
        return JsonSchemaFormat(dict(JSON_OBJECT), name="json_object")
    if not isinstance(fmt, JsonSchemaResponseFormat):
        return None
    spec = fmt.json_schema
    try:
        check_name(spec.name)  # the same rule as for function names
    except ToolError as exc:
        raise _invalid("response_format.json_schema.name", exc.message) from None
    schema = {} if spec.json_schema is None else spec.json_schema
    try:
        check_schema(schema)
    except ToolError as exc:
        raise _invalid("response_format.json_schema.schema", exc.message) from None
    return JsonSchemaFormat(dict(schema), name=spec.name)
