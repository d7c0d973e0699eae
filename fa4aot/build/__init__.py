"""Build stage: a spec's variants (`enumerate`, `mla`) cross-compiled into a store (`builder`)."""
