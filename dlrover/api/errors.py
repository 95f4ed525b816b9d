"""Errors of a call to the master, the same from the gRPC client and the in-process API."""

from __future__ import annotations


class MasterClientError(Exception):
    """A call to the master failed; the message says what to do."""


class MasterUnreachableError(MasterClientError):
    """No master answered at the address within the deadline."""


class WrongTokenError(MasterClientError):
    """The master refused the job token."""


class UnsupportedCallError(MasterClientError):
    """The master does not know the call: it runs an older release than this client."""


class MasterRequestError(MasterClientError):
    """The master refused the request as invalid (unknown node, bad configuration...)."""


class UnknownNodeError(MasterRequestError):
    """The master does not know the node id (it lost it, or restarted without it): register
    again."""
