"""The capture routes, in one table: each route's name and what it is (Dynamo-based, with opaque parts,
deciding values from the example).

Why a table: the rest of fxprep asks a route what it is (``Route(result.tracer).dynamo``) instead of
comparing its name (``tracer.startswith("dynamo")``), so a new route is one member here plus its
capture function (docs/architecture.md, "A new capture route"); ``tests/test_layout.py`` refuses a
comparison against a route's name anywhere else. A ``Route`` is a ``str``: reports, saved metadata and
every user-visible text keep the plain name (``"dynamo+leaves"``), and a name read back from a file
or a report compares equal to its member (``Route(name)`` gives the member).
"""

from __future__ import annotations

from enum import Enum


class Route(str, Enum):
    """A capture route: its name (what reports and saves show) and its properties."""

    dynamo: bool
    leaves: bool
    values: bool

    def __new__(cls, name: str, *properties: bool) -> Route:
        """A member from its row below (``Route(name)`` looks a member up by its name: Enum's own lookup)."""
        member = str.__new__(cls, name)
        member._value_ = name
        member.dynamo, member.leaves, member.values = properties
        return member

    #                 name             Dynamo-based  opaque parts  values from the example
    DYNAMO = ("dynamo", True, False, False)
    DYNAMO_LEAVES = ("dynamo+leaves", True, True, False)
    DYNAMO_VALUES = ("dynamo+values", True, False, True)
    FX = ("fx", False, False, False)
    FX_LEAVES = ("fx+leaves", False, True, False)
    HF_FX = ("hf_fx", False, False, False)  # transformers' own fx tracer (transformers < 5), fx's fallback

    def __str__(self) -> str:  # the plain name in str(), %s and f-strings, as before routes were members
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(self, spec)

    @property
    def whole(self) -> bool:
        """Captures the whole model as it runs: nothing opaque, nothing decided from the example (the
        routes tried first; the others are the fallback after they all failed)."""
        return not (self.leaves or self.values)

    @property
    def rules(self) -> Route:
        """The tracer whose rules the graph follows (:data:`DYNAMO`'s static shapes where not declared
        dynamic, or :data:`FX`'s): what the input guard records and a failure is diagnosed as."""
        return Route.DYNAMO if self.dynamo else Route.FX


__all__ = ["Route"]
