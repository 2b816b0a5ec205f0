"""Write preconditions: If-Match and If-None-Match as compares of a command (docs/http.md,
PUT /v1/kv/{key}), and the 412 a failed one answers."""

from __future__ import annotations

import re

from app.http.problems import ProblemError
from app.service import ApplyResult, Compare, CompareKind

# If-Match (RFC 9110 §13.1.1): * or a list of entity tags, quotes optional on a strong one
# (leniently). Weak tags never match (strong comparison); a write's condition is one compare
# on the key's mod_version, so a list may name at most one strong tag. _parse_if_match
# enforces exactly this grammar, with a detail saying what is wrong.
_ETAG_NUMBER = "[0-9]{1,18}"
_WEAK_ETAG = f'W/"{_ETAG_NUMBER}"'
_OWS = "[ \t]*"
IF_MATCH_PATTERN = (rf'^{_OWS}(\*|({_WEAK_ETAG}{_OWS},{_OWS})*({_WEAK_ETAG}|"{_ETAG_NUMBER}"|{_ETAG_NUMBER})'
                    rf'({_OWS},{_OWS}{_WEAK_ETAG})*){_OWS}$')
_STRONG_ETAG_RE = re.compile(f'"({_ETAG_NUMBER})"|({_ETAG_NUMBER})')
_WEAK_ETAG_RE = re.compile(f'W/"{_ETAG_NUMBER}"')


def _parse_if_match(value: str, key: str) -> tuple[Compare, ...]:
    """``If-Match: "<mod_version>"`` is compare-and-set; ``If-Match: *`` requires existence.

    Strong comparison (RFC 9110 §13.1.1): a weak tag ``W/"5"`` never matches, whatever the
    key's version, so a list of weak tags only is a condition that cannot hold. It is still
    proposed (as two contradicting compares) rather than answered here, so that it fails at
    apply time like any other condition: on the leader, with the key's current_version.
    A list of several strong tags would need an OR of compares, which a command cannot
    express (storage/commands.py: all compares must hold): 400, saying so."""
    elements = [element.strip(" \t") for element in value.split(",")]
    if "*" in elements:
        if len(elements) > 1:
            raise ProblemError(400, "invalid-precondition", "Invalid If-Match",
                               "If-Match: * cannot be combined with entity tags")
        return (Compare(key, CompareKind.EXISTS, True),)
    strong: list[int] = []
    for element in elements:
        if _WEAK_ETAG_RE.fullmatch(element):
            continue  # never matches
        match = _STRONG_ETAG_RE.fullmatch(element)
        if match is None:
            raise ProblemError(400, "invalid-precondition", "Invalid If-Match",
                               'If-Match must be * or "<mod_version>" (a quoted integer; a list may add weak W/"<n>" '
                               f"tags, which never match): {element[:40]!r} is not an entity tag")
        strong.append(int(match.group(1) or match.group(2)))
    if len(strong) > 1:
        raise ProblemError(400, "invalid-precondition", "Invalid If-Match",
                           "If-Match lists of several entity tags are not supported: a write's condition is one "
                           'compare of the key\'s mod_version; send one "<mod_version>"')
    if not strong:
        return (Compare(key, CompareKind.EXISTS, True), Compare(key, CompareKind.EXISTS, False))
    return (Compare(key, CompareKind.MOD_VERSION, strong[0]),)


def _parse_if_none_match(value: str, key: str) -> Compare:
    if value.strip() != "*":
        raise ProblemError(400, "invalid-precondition", "Invalid If-None-Match",
                           "only If-None-Match: * (create only) is supported on writes")
    return Compare(key, CompareKind.EXISTS, False)


def write_compares(key: str, if_match: str | None, if_none_match: str | None) -> tuple[Compare, ...]:
    """Both headers may be sent; both must hold (RFC 9110 evaluates If-Match, then If-None-Match)."""
    compares = []
    if if_match is not None:
        compares.extend(_parse_if_match(if_match, key))
    if if_none_match is not None:
        compares.append(_parse_if_none_match(if_none_match, key))
    return tuple(compares)


def check_condition(result: ApplyResult, key: str) -> None:
    if not result.succeeded:
        current = dict(result.failed_compares).get(key, 0)
        raise ProblemError(412, "precondition-failed", "Precondition failed",
                           f"the condition on {key!r} did not hold (its mod_version is {current})",
                           current_version=current)
