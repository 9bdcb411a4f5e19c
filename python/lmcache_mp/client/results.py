"""What requests return, and how a reply becomes a result or an exception."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lmcache_mp import protocol as p
from lmcache_mp.errors import CREDENTIAL_REVOKED, CredentialRevoked, ProtocolMismatch, RequestError, ServerUnavailable


@dataclass(frozen=True)
class StoreResult:
    stored: int  # chunks written by this request
    present: int  # chunks that were already stored
    skipped: int  # chunks the server had no memory for (everything else leased or in use)

    @property
    def chunks(self) -> int:
        """Leading chunks of the request now present on the server."""
        return self.stored + self.present


@dataclass(frozen=True)
class RetrieveResult:
    loaded: int  # leading chunks written into the given blocks


def is_revoked(reply: Any) -> bool:
    """Whether a reply is the refusal of a request of a revoked credential."""
    return (isinstance(reply, p.Error) and reply.code == p.ErrorCode.PERMISSION_DENIED
            and reply.message.startswith(CREDENTIAL_REVOKED))


def check_reply(reply: Any, expected: type) -> Any:
    """The reply if it is of the expected type; the error it carries raised otherwise."""
    if isinstance(reply, p.Error):
        if reply.code == p.ErrorCode.PROTOCOL_MISMATCH:
            raise ProtocolMismatch(reply.message)
        if reply.code == p.ErrorCode.SHUTTING_DOWN:
            raise ServerUnavailable(reply.message)
        if is_revoked(reply):
            raise CredentialRevoked(reply.message)
        raise RequestError(reply.code, reply.message)
    if not isinstance(reply, expected):
        raise RequestError(int(p.ErrorCode.INTERNAL), f"expected {expected.__name__}, got {type(reply).__name__}")
    return reply
