"""A factory module whose import fails (for the CLI tests)."""

raise RuntimeError("no GPU here")
