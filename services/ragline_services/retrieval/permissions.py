"""Who may write which documents (docs/security.md, "Writing documents").

A caller writes (Upsert, Delete) only when it holds the scope `ragline:write`, and only
within what it can see itself:
- every scope a written document's `acl` names is one the writer holds (an empty acl, a
  document every principal of the tenant sees, needs no more than the write scope);
- an existing document it cannot see is neither overwritten (PERMISSION_DENIED, naming the
  id) nor deleted (counted as not found, as if it were absent).
Decisions only; the index asks the engines which documents exist and which are visible.
"""

from __future__ import annotations

from dataclasses import dataclass

from ragline.errors import InvalidArgument, PermissionDenied
from ragline.identity import RESERVED_SCOPE_PREFIX, Caller, write_scope_missing
from ragline_services.retrieval.documents import Visibility


@dataclass(frozen=True)
class Writer:
    tenant: str
    scopes: frozenset[str] = frozenset()  # visibility scopes held
    may_write: bool = False

    @classmethod
    def of(cls, caller: Caller) -> Writer:
        return cls(caller.tenant, caller.visibility, caller.may_write)

    @property
    def visibility(self) -> Visibility:
        return Visibility(self.tenant, self.scopes)


def check_may_write(writer: Writer, what: str) -> None:
    if not writer.may_write:
        raise write_scope_missing(what)


def check_acls(writer: Writer, acls: list[tuple[str, ...]]) -> None:
    """Each document's acl (by position) names only scopes the writer holds."""
    for index, acl in enumerate(acls):
        for scope in acl:
            if scope.startswith(RESERVED_SCOPE_PREFIX):
                raise InvalidArgument(
                    f"documents[{index}].acl",
                    f"{scope!r} is a permission, not a visibility scope (the prefix "
                    f"{RESERVED_SCOPE_PREFIX!r} is reserved)",
                )
            if scope not in writer.scopes:
                raise PermissionDenied(
                    f"documents[{index}].acl names scope {scope!r}, which the writer does not "
                    "hold: a writer can make a document visible only to scopes it holds",
                    reason="ACL_SCOPE_NOT_HELD",
                    metadata={"field": f"documents[{index}].acl", "scope": scope},
                )


def refuse_hidden_overwrites(hidden: list[str]) -> None:
    """`hidden`: ids being written that name existing documents the writer cannot see."""
    if hidden:
        raise PermissionDenied(
            f"document {hidden[0]!r} exists and this writer cannot see it, so it may not "
            f"overwrite it ({len(hidden)} such id(s) in the request; nothing was written)",
            reason="DOCUMENT_NOT_VISIBLE",
            metadata={"id": hidden[0]},
        )
