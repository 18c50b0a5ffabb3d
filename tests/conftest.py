"""Test-wide JAX settings."""

import jax

# The suite compiles many small programs; XLA's optimisation passes cost more than they save
# there (compile time roughly halves). Numerics stay float32.
jax.config.update("jax_disable_most_optimizations", True)
