"""The `cpp-header` directive: a public header's documented declarations, read from the header itself.

    ```{cpp-header} exchange.hpp
    ```

Each `///` comment block in `api/include/handoff/<header>` and the declaration that follows it are
shown as a C++ block and the comment's text (Markdown, as the headers write it; `@throws`, `@note`
and `@param` as labelled paragraphs). Private and protected members, `detail` namespaces and
`///<` member notes are left out. The reference is never out of date with the headers, and the
headers stay the one place their API is described.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from docutils import nodes
from docutils.parsers.rst import Directive
from docutils.statemachine import StringList

HEADERS = Path(__file__).resolve().parents[2] / "api" / "include" / "handoff"
_STRING = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'')
_TYPE = re.compile(r"^\s*(?:template\s*<.*>\s*)?(class|struct)\s+(?:\[\[\w+\]\]\s+)?(\w+)\b(?!.*;\s*$)")
_ACCESS = re.compile(r"^\s*(public|private|protected)\s*:")
_TAGS = {"@throws": "Throws", "@note": "Note", "@param": "Parameter", "@return": "Returns", "@returns": "Returns"}


@dataclass
class Declaration:
    scope: str  # the enclosing class, or "" at namespace level
    code: str
    comment: list[str]


@dataclass
class _Scope:
    name: str
    depth: int  # the brace depth inside it
    public: bool
    hidden: bool  # a detail namespace, or a class inside a private section


def _code_only(line: str) -> str:
    """The line without its comment and string literals, for counting braces."""
    return _STRING.sub('""', line).split("//", 1)[0]


def _declaration(lines: list[str]) -> str:
    """The declaration alone: no body, no member initializers."""
    text = "\n".join(line.rstrip() for line in lines)
    body = re.search(r"\{(?!\s*\})", text)
    if body is not None:
        text = text[: body.start()].rstrip()
    text = re.sub(r"(\)\s*(?:const\s*)?(?:noexcept\s*)?)\s*:\s*\w+\(.*$", r"\1", text, flags=re.S)
    text = re.sub(r"\s*\{\s*\}\s*$", "", text)
    return text.rstrip() if text.rstrip().endswith(";") else text.rstrip() + ";"


def documented(header: str) -> list[Declaration]:
    """The documented public declarations of `header`, in order."""
    lines = (HEADERS / header).read_text().splitlines()
    found: list[Declaration] = []
    scopes: list[_Scope] = []
    depth = 0
    comment: list[str] = []
    pending: list[str] | None = None  # a documented declaration being read
    pending_type: tuple[str, bool] | None = None  # a class being opened: (name, public by default)

    def visible() -> bool:
        return not any(s.hidden or not s.public for s in scopes)

    for line in lines:
        stripped = line.strip()
        if stripped.startswith("///") and not stripped.startswith("///<"):
            comment.append(stripped[3:].removeprefix(" "))
            continue
        code = _code_only(line)
        if (access := _ACCESS.match(code)) and scopes:
            scopes[-1].public = access.group(1) == "public"
            comment = []
            continue
        if comment and pending is None and stripped and visible():
            pending = []
        if pending is not None:
            without_note = re.sub(r"\s*//.*$", "", line.strip())  # a `///<` note, say
            pending.append(without_note if not pending else "    " + without_note)
            if re.search(r"[;{}]\s*$", code.rstrip()) or re.search(r"\{(?!\s*\})", code):
                scope = next((s.name for s in reversed(scopes) if s.name), "")
                found.append(Declaration(scope, _declaration(pending), comment))
                pending, comment = None, []
        elif stripped and not stripped.startswith("//"):
            comment = []
        if (kind := _TYPE.match(code)) is not None:
            pending_type = (kind.group(2), kind.group(1) == "struct")
        namespace = re.match(r"^\s*namespace\s+([\w:]*)", code)
        for char in code:
            if char == "{":
                depth += 1
                if pending_type is not None:
                    scopes.append(_Scope(pending_type[0], depth, pending_type[1], not visible()))
                    pending_type = None
                elif namespace is not None:
                    scopes.append(_Scope("", depth, True, "detail" in namespace.group(1).split("::")))
                    namespace = None
                else:
                    scopes.append(_Scope("", depth, True, False))
            elif char == "}":
                if scopes and scopes[-1].depth == depth:
                    scopes.pop()
                depth -= 1
        if ";" in code and pending_type is not None and "{" not in code:
            pending_type = None  # a forward declaration
    return found


def _markdown(comment: list[str]) -> list[str]:
    """The comment as Markdown paragraphs, its tags labelled."""
    out: list[str] = []
    for line in comment:
        tag = line.split(" ", 1)[0]
        if tag in _TAGS:
            out += ["", f"*{_TAGS[tag]}:* {line[len(tag) :].strip()}"]
        else:
            out.append(line)
    return out


class CppHeader(Directive):
    required_arguments = 1
    has_content = False

    def run(self) -> list[nodes.Node]:
        header = self.arguments[0]
        if not (HEADERS / header).is_file():
            raise self.error(f"cpp-header: no {header} in {HEADERS}")
        result: list[nodes.Node] = []
        for declaration in documented(header):
            scope = f"// in {declaration.scope}\n" if declaration.scope else ""
            block = nodes.literal_block(text=scope + declaration.code, language="cpp")
            block["classes"].append("cpp-declaration")
            result.append(block)
            text = nodes.container()
            self.state.nested_parse(StringList(_markdown(declaration.comment), source=str(HEADERS / header)), 0, text)
            result.append(text)
        return result


def setup(app):
    app.add_directive("cpp-header", CppHeader)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
