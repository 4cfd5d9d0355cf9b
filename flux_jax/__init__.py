"""FLUX.1 rectified-flow transformers in JAX/Flax with FP8 training."""

__version__ = "0.1.0"
