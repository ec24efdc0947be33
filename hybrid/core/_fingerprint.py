"""Canonical JSON and fingerprints shared by every plan type."""

from __future__ import annotations

import hashlib
import json


def canonical_json(obj: dict) -> str:
    """The one serialisation used for fingerprints: sorted keys, no whitespace."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def fingerprint_of(obj: dict) -> str:
    """First 16 hex digits of the SHA-256 of the canonical JSON: equal in every process."""
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()[:16]
