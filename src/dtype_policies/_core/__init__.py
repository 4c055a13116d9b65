"""The one call core: `CallState`, `run_call`, casting, the autocast scope,
the traced path, kept weight casts and the per-module application stack
(docs/architecture.md, floor 4). A regular package, so that every module of
it is imported once, under its own name (pytest's doctest collection imports
a namespace package's modules a second time, as top-level modules)."""
