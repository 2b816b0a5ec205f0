"""The dashboard's modes (``metakv serve --ui``): served with edits, not at all, or without
edit controls for anyone."""

from __future__ import annotations

from typing import Literal, get_args

UiMode = Literal["on", "off", "read-only"]
UI_MODES: tuple[str, ...] = get_args(UiMode)
