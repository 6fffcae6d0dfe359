"""XLA compiler options per kind of jitted step, chosen from measurements on XLA:CPU.

jaxlib 0.10's XLA:CPU hands convolutions, dots, elementwise ops and reductions to
YNNPACK by default. `benchmarks/profile_step.py` on cpjax's ResNet-18 train step
(2-core AMD EPYC, batch 128) put 37 % of the op time in YNNPACK weight-gradient
convolutions and 20 % in the transposes feeding them. With convolutions left on
XLA's own (Eigen) path and YNNPACK kept for the rest, the same train step ran
1.6x faster; the inference steps (evaluation, scoring) ran 2.2x faster with
YNNPACK off entirely (figures and commands: benchmarks/RESULTS.md).

The options go per jit (`jax.jit(..., compiler_options=...)`): nothing global
changes, and backends other than CPU get none. `config.xla_cpu_options =
"xla_default"` turns them off.
"""

import jax

KINDS = ("train", "inference", "solver")
PRESETS = ("tuned", "xla_default")

_YNN_FUSIONS = "xla_cpu_experimental_ynn_fusion_type"
_TUNED_CPU = {
    "train": {_YNN_FUSIONS: "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,"
                            "LIBRARY_FUSION_TYPE_ELTWISE,LIBRARY_FUSION_TYPE_REDUCE"},
    "inference": {_YNN_FUSIONS: ""},
    # The report's post-hoc fits with many parameters (cpjax.calibration.newton): YNNPACK's
    # batched products ran 12x slower than XLA's own on matrix scaling at K = 100.
    "solver": {_YNN_FUSIONS: ""},
}


def compiler_options(kind: str, preset: str = "tuned",
                     backend: str | None = None) -> dict[str, str]:
  """Options for `jax.jit(..., compiler_options=...)` of a `kind` step.

  Args:
    kind: "train" (forward + backward + update), "inference" (forward only) or "solver"
      (the report's post-hoc fits in JAX).
    preset: "tuned" (the measured CPU options) or "xla_default" (none).
    backend: the jax backend; default `jax.default_backend()`.
  """
  if kind not in KINDS:
    raise ValueError(f"compiler options kind must be one of {KINDS}, got {kind!r}")
  if preset not in PRESETS:
    raise ValueError(f"xla_cpu_options must be one of {PRESETS}, got {preset!r}")
  if preset == "xla_default" or (backend or jax.default_backend()) != "cpu":
    return {}
  return dict(_TUNED_CPU[kind])
