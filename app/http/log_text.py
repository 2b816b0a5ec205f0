"""Request data in log lines: control characters escaped, so input cannot forge log lines.

A path arrives percent-decoded (``/v1/kv/a%0Aforged`` holds a newline); logged as it is, it
would start a line that looks like the node's own. Every log line that carries request input
(path, method, key, token name) passes it through ``loggable``.
"""

from __future__ import annotations


def loggable(value: object) -> str:
    """``str(value)`` with every non-printable character (newline, CR, ESC, U+2028 ...) written
    as its Python escape (``\\n``, ``\\x1b``)."""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else char.encode("unicode_escape").decode("ascii") for char in text)
