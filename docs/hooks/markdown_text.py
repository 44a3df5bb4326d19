"""Text from docstrings and schemas, made safe to drop into generated Markdown."""

from __future__ import annotations

import html
import re

_SPECIALS = re.compile(r"([\\*_\[\]|])")


def escape(text: str) -> str:
    """One line of Markdown that reads as the text was written: code spans kept as they are, the
    rest with its HTML (`<role>`) and Markdown characters (`a|b` in a table, `snake_case`) escaped."""
    parts = " ".join(str(text).split()).split("`")
    for i in range(0, len(parts), 2):  # the even parts lie outside code spans
        parts[i] = _SPECIALS.sub(r"\\\1", html.escape(parts[i], quote=False))
    return "`".join(parts)


def paragraphs(text: str) -> list[str]:
    """A docstring's paragraphs, each escaped onto one line."""
    return [escape(paragraph) for paragraph in re.split(r"\n\s*\n", text.strip()) if paragraph.strip()]
