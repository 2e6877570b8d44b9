"""``custom_jvp_call`` / ``custom_vjp_call`` (filled in by the higher-order issue)."""
