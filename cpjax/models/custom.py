"""A user's own Flax module as the model: `--config.model.name=package.module:ClassName`.

The contract (docs/extending.md#add-a-model):

* `ClassName` is a `flax.linen.Module` subclass; `package.module` must be importable
  (installed, or on PYTHONPATH).
* cpjax constructs it as `ClassName(num_classes=K, dtype=D)`: K the dataset's number of
  classes, D the compute dtype of `config.model.dtype` (`jnp.float32` or `jnp.bfloat16`).
  Parameters stay float32 (flax's default `param_dtype`); compute in D. A module without a
  `dtype` field is built as `ClassName(num_classes=K)` and computes in its own dtype (a
  one-line notice where `config.model.dtype` asked for another); its logits are cast to
  float32 either way.
* `__call__(x, train)`: `x` float32 [B, H, W, C], normalised images of the dataset's shape;
  `train` a Python bool, True in the train step (BatchNorm on batch statistics), False for
  evaluation and scoring. It returns logits [B, K], or (logits [B, K], features [B, d]).
* Variables: "params", and "batch_stats" if it keeps running statistics (the one collection
  cpjax updates, in train mode). cpjax passes no random key to `apply`, so no dropout.
* The FL_gamma losses (`flgamma_*`) read the penultimate features and take a look-ahead
  step of the classifier alone: they need (logits, features) and a Dense layer named "head"
  with logits = features @ head.kernel + head.bias.

Everything is checked before any data is read or anything compiled: the import
(`import_problem`, at config validation), then the construction and the contract on one
dummy batch of the dataset's shape with `jax.eval_shape` (`contract_problems`).
"""

import dataclasses
import importlib
import logging
import re
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
COLLECTIONS = ("params", "batch_stats")  # The variable collections cpjax keeps.


class ModelContractError(ValueError):
  """A user's module cannot be imported, built or used as cpjax's contract says."""


def is_import_path(name: str) -> bool:
  """Whether `name` names a module by import path ("package.module:ClassName")."""
  return ":" in name


def load(path: str) -> type[nn.Module]:
  """The `flax.linen.Module` subclass that "package.module:ClassName" names.

  Raises:
    ModelContractError: malformed path, module not importable, attribute missing, or not a
      flax.linen.Module subclass; the message names the bad part.
  """
  if not _IMPORT_PATH.match(path):
    raise ModelContractError(f"got {path!r}; an import path is 'package.module:ClassName'")
  module_name, attribute = path.split(":")
  try:
    module = importlib.import_module(module_name)
  except Exception as err:  # Any error of the user's code at import: report it, one line.
    raise ModelContractError(f"got {path!r}: cannot import module {module_name!r} "
                             f"({type(err).__name__}: {err}); is it on PYTHONPATH?") from err
  target = module
  for part in attribute.split("."):
    if not hasattr(target, part):
      modules = sorted(k for k, v in vars(module).items()
                       if isinstance(v, type) and issubclass(v, nn.Module))
      raise ModelContractError(
          f"got {path!r}: module {module_name!r} ({getattr(module, '__file__', '?')}) has no "
          f"attribute {attribute!r}; its flax modules: {', '.join(modules) or 'none'}")
    target = getattr(target, part)
  if not (isinstance(target, type) and issubclass(target, nn.Module)):
    raise ModelContractError(f"got {path!r}: {attribute} is {target!r}, not a "
                             "flax.linen.Module subclass")
  return target


def import_problem(path: str) -> str | None:
  """`load`'s error message, or None when `path` names a flax.linen.Module subclass."""
  try:
    load(path)
  except ModelContractError as err:
    return str(err)
  return None


class ContractModel(nn.Module):
  """A user's module under cpjax's output contract, its variables unchanged.

  The wrapper shares the user module's scope (`nn.share_scope`), so the parameter tree,
  and each parameter's initial value, is the user module's own. Returns (float32 logits,
  features), features None when the module returns logits alone.
  """
  module: nn.Module

  def setup(self):
    nn.share_scope(self, self.module)

  def __call__(self, x: jax.Array, train: bool = False) -> tuple[jax.Array, Any]:
    out = self.module(x, train=train)
    logits, features = out if isinstance(out, tuple) else (out, None)
    return logits.astype(jnp.float32), features


_NOTIFIED: set[tuple[str, str]] = set()  # (path, dtype) whose dtype notice was logged.


def _has_field(cls: type[nn.Module], name: str) -> bool:
  return name in {field.name for field in dataclasses.fields(cls)}


def create(path: str, num_classes: int, dtype: jnp.dtype) -> ContractModel:
  """The module "package.module:ClassName" built with (num_classes, dtype), wrapped; a
  module without a `dtype` field is built with num_classes alone and computes in its own
  dtype (a one-line notice, once, where `dtype` asked for another than float32).

  Raises:
    ModelContractError: as `load`, or the class does not take those keyword arguments.
  """
  cls = load(path)
  takes_dtype = _has_field(cls, "dtype")
  kwargs = {"num_classes": num_classes, **({"dtype": dtype} if takes_dtype else {})}
  try:
    module = cls(**kwargs)
  except TypeError as err:
    shown = ", ".join(f"{k}={jnp.dtype(v).name if k == 'dtype' else v}"
                      for k, v in kwargs.items())
    raise ModelContractError(
        f"got {path!r}: cpjax builds it as {cls.__name__}({shown}), which failed: {err}; "
        "declare the field `num_classes: int` (and optionally `dtype: Any = jnp.float32`, "
        "the compute dtype of config.model.dtype)") from err
  name = jnp.dtype(dtype).name
  if not takes_dtype and name != "float32" and (path, name) not in _NOTIFIED:
    _NOTIFIED.add((path, name))
    logging.warning("model.dtype=%s is not passed to %s: it has no `dtype` field, so it "
                    "computes in its own dtype (declare `dtype: Any = jnp.float32` to take "
                    "model.dtype).", name, path)
  return ContractModel(module=module)


def contract_problems(path: str, image_shape: tuple[int, ...], num_classes: int,
                      dtype: str, needs_head: bool) -> list[str]:
  """What keeps the module at `path` from training on images of `image_shape`.

  Builds it, then traces (`jax.eval_shape`: nothing is computed or compiled) its init and
  its eval-mode and train-mode apply on a dummy float32 batch [2, *image_shape].

  Args:
    path: "package.module:ClassName".
    image_shape: the dataset's [H, W, C].
    num_classes: the dataset's classes K.
    dtype: config.model.dtype.
    needs_head: the loss reads features and updates the classifier alone (FL_gamma).

  Returns:
    One line per problem, each starting with the path; empty when it meets the contract.
  """
  try:
    model = create(path, num_classes, jnp.dtype(dtype))
  except ModelContractError as err:
    return [str(err)]
  x = jax.ShapeDtypeStruct((2, *image_shape), jnp.float32)
  shape = f"[2, {', '.join(map(str, image_shape))}]"
  try:
    variables = jax.eval_shape(lambda v: model.module.init(jax.random.PRNGKey(0), v,
                                                           train=False), x)
  except Exception as err:  # The user's code: report whatever it raised.
    return [f"{path!r}: init on a float32 batch {shape} failed: {type(err).__name__}: {err}"]
  problems = _variable_problems(path, variables)
  output_problems = []
  for train in (False, True):
    try:
      out = jax.eval_shape(lambda v, x, t=train: model.module.apply(
          v, x, train=t, mutable=["batch_stats"] if t else False), variables, x)
    except Exception as err:  # E.g. dropout asking for a random key cpjax does not pass.
      problems.append(f"{path!r}: apply(x, train={train}) on a float32 batch {shape} failed: "
                      f"{type(err).__name__}: {err}")
      continue
    if not output_problems:  # A bad output in eval mode is reported once.
      output_problems = _output_problems(path, out[0] if train else out, num_classes, train,
                                         needs_head, variables.get("params", {}))
  return problems + output_problems


def _variable_problems(path: str, variables: dict[str, Any]) -> list[str]:
  """Only params and batch_stats; float32 params."""
  problems = []
  if extra := sorted(set(variables) - set(COLLECTIONS)):
    problems.append(f"{path!r}: variable collections {extra}: cpjax keeps only {COLLECTIONS}")
  params = jax.tree.leaves(variables.get("params", {}))
  if not params:
    problems.append(f"{path!r}: has no parameters to train")
  if dtypes := sorted({p.dtype.name for p in params} - {"float32"}):
    problems.append(f"{path!r}: parameters of dtype {dtypes}: keep them float32 (flax's default "
                    "param_dtype) and compute in the `dtype` field")
  return problems


def _output_problems(path: str, out: Any, num_classes: int, train: bool, needs_head: bool,
                     params: dict[str, Any]) -> list[str]:
  """Logits [2, K] or (logits [2, K], features [2, d]); a matching head if `needs_head`."""
  where = f"{path!r}: apply(x, train={train}) returned"
  is_array = isinstance(out, jax.ShapeDtypeStruct)
  pair = isinstance(out, tuple) and len(out) == 2 and all(
      isinstance(o, jax.ShapeDtypeStruct) for o in out)
  if not (is_array or pair):
    return [f"{where} {jax.tree.map(lambda a: f'{a.dtype}{list(a.shape)}', out)}; it must "
            f"return logits [B, {num_classes}] or (logits [B, {num_classes}], features [B, d])"]
  logits, features = (out, None) if is_array else out
  problems = []
  if logits.shape != (2, num_classes) or not jnp.issubdtype(logits.dtype, jnp.floating):
    problems.append(f"{where} logits {logits.dtype}{list(logits.shape)}; expected a float "
                    f"array [2, {num_classes}] (batch, the dataset's classes)")
  if features is not None and (features.ndim != 2 or features.shape[0] != 2):
    problems.append(f"{where} features {list(features.shape)}; expected [2, d]")
  if needs_head and not problems:
    problems += _head_problems(path, features, num_classes, params)
  return problems


def _head_problems(path: str, features: Any, num_classes: int,
                   params: dict[str, Any]) -> list[str]:
  """FL_gamma's look-ahead: logits = features @ params["head"]["kernel"] + ["bias"]."""
  need = ("the flgamma_* losses need (logits, features) from __call__ and a Dense layer "
          "named 'head' (logits = features @ head.kernel + head.bias)")
  if features is None:
    return [f"{path!r}: returns logits alone; {need}"]
  head = params.get("head", {})
  shapes = {k: tuple(v.shape) for k, v in head.items()} if isinstance(head, dict) else {}
  d = features.shape[1]
  if shapes != {"kernel": (d, num_classes), "bias": (num_classes,)}:
    return [f"{path!r}: params['head'] is {shapes or 'missing'}, expected kernel "
            f"{(d, num_classes)} and bias {(num_classes,)}; {need}"]
  return []
