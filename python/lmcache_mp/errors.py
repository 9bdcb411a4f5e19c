"""Exceptions raised by lmcache-mp (client and server share these names)."""

from __future__ import annotations


class LMCacheMPError(Exception):
    """Base class of every lmcache-mp error."""


class ServerUnavailable(LMCacheMPError, ConnectionError):
    """The server did not answer in time, is not running, or restarted mid-request."""


class ProtocolMismatch(LMCacheMPError):
    """Client and server speak different protocol versions."""


class RequestError(LMCacheMPError):
    """The server rejected a request; `code` says why (see protocol.ErrorCode)."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        from lmcache_mp.protocol import ErrorCode

        try:
            name = ErrorCode(self.code).name
        except ValueError:
            name = str(self.code)
        return f"[{name}] {self.message}"
