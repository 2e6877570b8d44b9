"""Control flow: ``scan``, ``while``, ``cond`` (filled in by the higher-order issue)."""
