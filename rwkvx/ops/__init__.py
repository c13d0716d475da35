"""Launch builders, one module per rwkvx/cu/<family>.cu (see docs/DESIGN.md)."""
