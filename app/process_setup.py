"""Process-wide settings ``metakv serve`` makes before it opens anything (docs/security.md).

- The soft file-descriptor limit goes up to the hard one: every client and peer connection
  holds a descriptor, and the usual soft 1024 lets ~1,000 idle connections starve the node.
- The umask becomes 0o077, so whatever the node creates (segments, quorum-state, state.db and
  the WAL and SHM files SQLite makes on its own) is readable by its owner only, as etcd does.
"""

from __future__ import annotations

import logging
import os
import resource

logger = logging.getLogger("metakv.process")

PRIVATE_UMASK = 0o077


def raise_descriptor_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:  # some platforms cap below the hard limit
            logger.warning("cannot raise the file descriptor limit from %d to %d: %s", soft, hard, exc)
            return soft
        return hard
    return soft


def prepare_serving_process() -> None:
    """The settings of the module docstring; called once, first thing in ``serve``."""
    os.umask(PRIVATE_UMASK)
    limit = raise_descriptor_limit()
    logger.info("file descriptor limit %d", limit)
