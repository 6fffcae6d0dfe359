"""Test setup: 8 forced CPU devices, before any JAX computation."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import jax  # pylint: disable=g-import-not-at-top

jax.config.update("jax_num_cpu_devices", 8)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
