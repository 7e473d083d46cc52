"""Chat requests: their ``messages`` and ``tools`` checked, then rendered by the model's chat
template into prompt token ids.

Tool definitions go to the tokenizer's template (``apply_chat_template(..., tools=...)``) when
that template reads them; a model whose template does not is refused with a 400 naming ``tools``
(rather than the definitions being dropped without a word). Assistant messages with
``tool_calls`` and ``tool`` messages pass through to the template as they are, so a client can
send a tool's result back.
"""
from __future__ import annotations

from typing import Any

from system.errors import ConfigError

ROLES = ("system", "user", "assistant", "tool", "developer")
MAX_TOOLS = 128
"""Most tool definitions per request."""
TOOL_CHOICES = ("none", "auto")


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``messages`` of a chat completion, each with a ``role`` and text ``content`` (a string,
    or a list of ``{"type": "text", "text"}`` parts, joined; ``null`` on an assistant message
    with ``tool_calls``), plus ``tool_calls``, ``tool_call_id`` and ``name`` where given."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ConfigError("messages must be a non-empty list")
    return [_message(i, m) for i, m in enumerate(messages)]


def _message(i: int, m: Any) -> dict[str, Any]:
    if not isinstance(m, dict):
        raise ConfigError(f"messages[{i}] must be an object")
    role, content = m.get("role"), m.get("content")
    if role not in ROLES:
        raise ConfigError(f"messages[{i}].role must be one of {', '.join(ROLES)}")
    out: dict[str, Any] = {"role": role}
    calls = m.get("tool_calls")
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list):
            raise ConfigError(f"messages[{i}].tool_calls must be a list, on an assistant message")
        out["tool_calls"] = [_tool_call(i, j, c) for j, c in enumerate(calls)]
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text"
                   and isinstance(p.get("text"), str) for p in content):
            raise ConfigError(f"messages[{i}].content parts must be "
                              "{\"type\": \"text\", \"text\": ...} (text only)")
        content = "".join(p["text"] for p in content)
    if content is None and calls is not None:
        content = ""
    if not isinstance(content, str):
        raise ConfigError(f"messages[{i}].content must be a string")
    out["content"] = content
    for key in ("tool_call_id", "name"):
        if m.get(key) is not None:
            if not isinstance(m[key], str):
                raise ConfigError(f"messages[{i}].{key} must be a string")
            out[key] = m[key]
    return out


def _tool_call(i: int, j: int, call: Any) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)
            and isinstance(fn.get("arguments", ""), (str, dict))):
        raise ConfigError(f"messages[{i}].tool_calls[{j}] must be {{\"type\": \"function\", "
                          "\"function\": {\"name\": str, \"arguments\": str}}")
    return {"id": str(call.get("id", "")), "type": "function",
            "function": {"name": fn["name"], "arguments": fn.get("arguments", "")}}


def chat_tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """``tools`` (function definitions), or ``None`` when absent or ``tool_choice`` is
    ``none``; ``tool_choice`` may be ``auto`` or ``none`` (a forced call is not supported)."""
    choice = body.get("tool_choice")
    if choice is not None and choice not in TOOL_CHOICES:
        raise ConfigError(f"tool_choice must be one of {', '.join(TOOL_CHOICES)} (a forced "
                          "tool call is not supported)")
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not tools or len(tools) > MAX_TOOLS:
        raise ConfigError(f"tools must be a list of 1 to {MAX_TOOLS} function definitions")
    for k, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (tool.get("type") != "function" or not isinstance(fn, dict)
                or not isinstance(fn.get("name"), str) or not fn["name"]
                or not isinstance(fn.get("parameters", {}), dict)
                or not isinstance(fn.get("description", ""), str)):
            raise ConfigError(f"tools[{k}] must be {{\"type\": \"function\", \"function\": "
                              "{\"name\": str, \"description\"?: str, \"parameters\"?: object}}")
    return None if choice == "none" else tools


def takes_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template reads tool definitions (a template that never
    names ``tools`` would drop them)."""
    template = getattr(tokenizer, "chat_template", None)
    texts = template.values() if isinstance(template, dict) else [template]
    return any(isinstance(t, str) and "tools" in t for t in texts)


def render_chat(tokenizer: Any, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None) -> list[int]:
    """Prompt token ids of ``messages`` (and ``tools``) through the tokenizer's chat template;
    without a template, the contents concatenated (and no tools). The caller holds the
    tokenizer's lock."""
    if not getattr(tokenizer, "chat_template", None):
        if tools is not None:
            raise ConfigError("tools: this model's tokenizer has no chat template to take them")
        return [int(t) for t in tokenizer.encode("".join(m["content"] for m in messages))]
    if tools is not None and not takes_tools(tokenizer):
        raise ConfigError("tools: this model's chat template does not take tool definitions")
    kwargs: dict[str, Any] = {"tools": tools} if tools is not None else {}
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            **kwargs)
    except Exception as e:  # the template refused these messages (jinja raised)
        raise ConfigError(f"messages: the chat template failed: {type(e).__name__}: "
                          f"{str(e)[:200]}") from None
    if hasattr(ids, "keys"):  # a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]
