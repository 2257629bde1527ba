"""Models fp8jax did not define: standard Flax layers and ``jax.lax`` ops only.

They import nothing from fp8jax: the door (:mod:`fp8jax.interop`) reaches
them from outside, through Qwix's interception or the layers' own
``dot_general=`` / ``einsum_op=`` hooks, which each model passes through.
"""
