"""Chat templates rendered in a Jinja sandbox (transformers' dialect: `tojson`,
`raise_exception`, `strftime_now`, `{% generation %}`), the roles a template knows by name,
and the checks that chat messages pass before they are rendered."""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _GenerationTag(jinja2.ext.Extension):
    """Accept `{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker) and
    render its body unchanged; we never need the mask."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters, which would change the prompt text.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


# Roles every chat template is assumed to handle; others only where the template names them.
STANDARD_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
# `role == 'x'`, `role != "x"`, `'x' == message.role`, `role in ['x', 'y']` in a template.
_ROLE_TESTS = re.compile(
    r"""role['"]?\]?\s*(?:==|!=)\s*['"]([^'"]+)['"]"""
    r"""|['"]([^'"]+)['"]\s*(?:==|!=)\s*[\w.\[\]'"]*role\b"""
    r"""|role['"]?\]?\s+(?:not\s+)?in\s*[\[(]([^\])]*)[\])]""")


def template_roles(template: str) -> frozenset[str]:
    """The roles a chat template tests for by name (beyond STANDARD_ROLES)."""
    roles: set[str] = set()
    for eq, rev, listed in _ROLE_TESTS.findall(template):
        roles.update(r for r in (eq, rev) if r)
        roles.update(re.findall(r"""['"]([^'"]+)['"]""", listed))
    return frozenset(roles)


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check chat messages and return copies whose content is a plain string.

    A message is a dict with a str ``role`` and a ``content`` that is a str or a list of
    ``{"type": "text", "text": ...}`` parts (concatenated); an assistant message with
    ``tool_calls`` may have no content. Raises ValueError naming the message index and field.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of dicts")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ValueError(f"messages[{i}] must be a dict, got {type(msg).__name__}")
        if not isinstance(msg.get("role"), str):
            raise ValueError(f"messages[{i}].role must be a string, got {msg.get('role')!r}")
        content = msg.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if (not isinstance(part, dict) or part.get("type") != "text"
                        or not isinstance(part.get("text"), str)):
                    raise ValueError(f"messages[{i}].content[{j}] must be "
                                     '{"type": "text", "text": <str>}')
                texts.append(part["text"])
            content = "".join(texts)
        elif not isinstance(content, str) and not (content is None and msg.get("tool_calls")):
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts, "
                             f"got {type(content).__name__}")
        out.append({**msg, "content": content})
    return out
