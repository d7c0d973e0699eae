"""What a spec needs on one arch: the variants, each with the call that compiles it, and the
layers fa4aot cannot serve (with what serves them instead, if anything)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fa4aot.model.compile_keys import Call
from fa4aot.model.variants import Variant


@dataclass(frozen=True)
class Need:
    """A variant a spec needs, with the call that compiles it and who asked for it."""

    variant: Variant
    call: Call
    spec: str
    layer: str


@dataclass(frozen=True)
class Unsupported:
    spec: str
    layer: str
    reason: str
    served_by: str | None = None  # the padded variant that serves it instead, if any


@dataclass
class Plan:
    needs: list[Need] = field(default_factory=list)
    unsupported: list[Unsupported] = field(default_factory=list)

    def variants(self) -> dict[str, Need]:
        """Distinct variants by id (first asker wins)."""
        out: dict[str, Need] = {}
        for n in self.needs:
            out.setdefault(n.variant.id, n)
        return out


