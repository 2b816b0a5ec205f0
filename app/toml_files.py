"""Reading a TOML file given on the command line, with one-line errors that name it.

Both the node's ``--config`` file and its ``--auth-file`` token file are read this way, so
a missing, unreadable or malformed file reads the same whichever flag named it.
"""

from __future__ import annotations

import os
import tomllib
from typing import Any


class TomlFileError(ValueError):
    """The file cannot be used; the message is one line that starts with ``where``."""


def read_toml(path: str | os.PathLike[str], where: str) -> dict[str, Any]:
    """The parsed file; ``where`` names it in every error (e.g. "--config: file 'x.toml'")."""
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise TomlFileError(f"{where} does not exist") from None
    except IsADirectoryError:
        raise TomlFileError(f"{where} is a directory") from None
    except OSError as exc:
        raise TomlFileError(f"{where}: cannot read it: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise TomlFileError(f"{where} is not valid TOML: {exc}") from None
    except UnicodeDecodeError:
        raise TomlFileError(f"{where} is not UTF-8 text") from None
