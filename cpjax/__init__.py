"""cpjax: calibration-aware training and calibration-guided sample prioritization in JAX."""
