"""Running out of file descriptors (EMFILE, ENFILE) while flushing is a shortage, not a disk error.

A flush opens or dups a descriptor before it fsyncs; failing there writes nothing and loses
nothing, so the flush can be retried once descriptors are free again (a failed fsync cannot:
the page cache is no longer trusted). Idle connections can exhaust descriptors at any time.
"""

from __future__ import annotations

import errno

OUT_OF_DESCRIPTORS_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE})


class FlushDeferredError(Exception):
    """A flush got no file descriptor; nothing was lost and the log stays writable: retry it."""


def out_of_descriptors(exc: OSError) -> bool:
    """Whether ``exc`` says the process (EMFILE) or the system (ENFILE) has no descriptor left."""
    return exc.errno in OUT_OF_DESCRIPTORS_ERRNOS


def deferred_flush(exc: OSError) -> FlushDeferredError:
    return FlushDeferredError(f"no file descriptor left to flush the log ({exc.strerror}); retrying")
