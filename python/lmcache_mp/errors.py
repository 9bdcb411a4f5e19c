"""Exceptions raised by lmcache-mp and the error codes of the server's replies (client and server
share these names; protocol.py carries the codes on the wire)."""

from __future__ import annotations

import enum


class ErrorCode(enum.IntEnum):
    BAD_REQUEST = 1  # undecodable or truncated frames, wrong field types
    UNKNOWN_OP = 2
    PROTOCOL_MISMATCH = 3
    INVALID_ARGUMENT = 4  # decodable but invalid: sizes, lengths, block-id bounds, names
    UNKNOWN_REGISTRATION = 5  # kv_id not registered (e.g. the server restarted)
    UNSUPPORTED = 6  # e.g. a CUDA cache on a server without the CUDA data plane
    DEVICE_ERROR = 7  # the copy itself failed
    SHUTTING_DOWN = 8
    INTERNAL = 9
    LIMIT_EXCEEDED = 10  # over a per-request or per-client limit (frame bytes, chunks, world size, leases)
    DEADLINE_EXCEEDED = 11  # a deadline passed: a retrieve wrote nothing, a store kept nothing
    PERMISSION_DENIED = 12  # the client's tenant may not do this (tenants file), or its credential was revoked


# How a refusal of a revoked credential's request begins (PERMISSION_DENIED): the client raises
# CredentialRevoked for it, and says so once.
CREDENTIAL_REVOKED = "credential revoked"


class LMCacheMPError(Exception):
    """Base class of every lmcache-mp error."""


class ServerUnavailable(LMCacheMPError, ConnectionError):
    """The server did not answer in time, is not running, or restarted mid-request."""


class ProtocolMismatch(LMCacheMPError):
    """Client and server speak different protocol versions."""


class RequestError(LMCacheMPError):
    """The server rejected a request; `code` says why (see ErrorCode)."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        try:
            name = ErrorCode(self.code).name
        except ValueError:
            name = str(self.code)
        return f"[{name}] {self.message}"


class CredentialRevoked(RequestError):
    """The server no longer accepts this client's credential (a reload removed it from the tenants
    file, or the server restarted without it): every request is refused, and the server closes
    the client's connections. A code of PERMISSION_DENIED; the message begins with "credential
    revoked". The client stays refused: give it an accepted key and make it again."""

    def __init__(self, message: str):
        super().__init__(int(ErrorCode.PERMISSION_DENIED), message)
