"""What makes two create requests the same one: the hash of the body as the caller sent it.

Both APIs answer a retried create with the job the first try made: the native one by
`Idempotency-Key` (rp_service.jobs.store keeps the key's body hash), OpenAI's by key or by
the body of a recent create (rp_service.openai.fine_tuning). One hash for both, so the two
agree on what "the same body" means.
"""

from __future__ import annotations

import hashlib
import json

from pydantic import BaseModel

__all__ = ["body_sha256"]


def body_sha256(body: BaseModel) -> str:
    """sha256 of the fields the caller set, keys sorted: a retry hashes the same whatever
    the order of its keys, and a default the daemon adds later does not change it."""
    data = body.model_dump(mode="json", exclude_unset=True)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()
