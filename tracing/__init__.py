"""tracing: torch.jit.trace-style trace checking and torch.jit.freeze-style freezing for JAX.

Not implemented yet: see the tracing and freeze issues. This package is a placeholder so that the
``jamp-autocast`` distribution installs both import packages from the start.
"""
