"""One error hierarchy. Every error says what went wrong and, where one exists, what to do."""
from __future__ import annotations

__all__ = ["AotfuseError", "ArchiveError", "GuardError", "UnsupportedOpError", "BuildError"]


class AotfuseError(Exception):
    """Base of every error aotfuse raises on purpose. The CLI prints these as one line."""

    def __init__(self, message: str, *, remedy: str | None = None):
        self.message = message
        self.remedy = remedy
        super().__init__(message if remedy is None else f"{message} ({remedy})")


class ArchiveError(AotfuseError):
    """The file is not a loadable aotfuse archive: says what is wrong and where."""


class GuardError(AotfuseError):
    """An input or the device does not satisfy the archive's guards: names it, expected vs got."""


class UnsupportedOpError(AotfuseError):
    """The model uses an op (or a case of one) the compiler cannot lower."""

    def __init__(self, op: str, node: str, detail: str = "", *, remedy: str | None = None):
        self.op = op
        self.node = node
        msg = f"unsupported op {op} at node {node!r}" + (f": {detail}" if detail else "")
        super().__init__(msg, remedy=remedy or "rewrite the model around it or open an issue naming the op")


class BuildError(AotfuseError):
    """A build stage failed for a reason other than an unsupported op."""
