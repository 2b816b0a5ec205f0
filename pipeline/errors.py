"""Errors the CLI turns into exit codes, and how they survive the trip back from executors.

An exception raised inside a Spark task reaches the driver wrapped in a Py4J/Python
traceback. The one line a user needs is carried inside a marker so the driver can find it
again, whatever the wrapping looks like.
"""

from __future__ import annotations

import re

EXIT_OK = 0
EXIT_DIVERGED = 1
EXIT_BAD_INPUT = 2

_MARKER = "METAKV_INPUT_ERROR<<{}>>"
_MARKER_PATTERN = re.compile(r"METAKV_INPUT_ERROR<<(.*?)>>")


class PipelineInputError(Exception):
    """The input is not something the pipeline can read faithfully (exit code 2)."""

    def __init__(self, message: str) -> None:
        super().__init__(_MARKER.format(message))
        self.message = message


def input_error_message(error: BaseException) -> str | None:
    """The one-line message of a PipelineInputError, also when raised in an executor."""
    if isinstance(error, PipelineInputError):
        return error.message
    match = _MARKER_PATTERN.search(str(error))
    return match.group(1) if match else None
