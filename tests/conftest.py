import jax

# Strict promotion catches a hook or policy that changes dtypes by accident.
jax.config.update("jax_numpy_dtype_promotion", "strict")
