"""cpjax's import layering, read from the source with `ast` (nothing is imported).

The package is layered bottom to top; a module may import only modules of its
own rank or below, and one of its own rank only within its own package (the
packages of a layer are siblings that do not know each other). Imports of
cpjax are top-level (a lazy import hides a dependency, and a cycle with it),
and the import graph has no cycle. Every module of cpjax has its rank in
RANKS, so a new module must be placed in the layering when it is added.
"""

import ast
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "cpjax"
ROOT = os.path.join(REPO, PACKAGE)

# Every module of cpjax (relative to cpjax; "" is cpjax/__init__.py, "data" is
# cpjax/data/__init__.py), bottom (0) to top. A package's __init__ runs whenever
# any of its modules is imported, so it sits at the rank of its lowest module.
RANKS = {
    "": 0,
    # 0: the registry pattern (entries with declared settings) and the checks of settings.
    "registry": 0,
    # 0: runtime: mesh, multi-host start-up, checkpoints, logs, files, XLA options.
    "runtime": 0,
    "runtime.advised": 0,
    "runtime.anatomy": 0,
    "runtime.checkpoint_integrity": 0,
    "runtime.checkpoint_room": 0,
    "runtime.checkpointing": 0,
    "runtime.compile_ahead": 0,
    "runtime.compilation_cache": 0,
    "runtime.compiler_options": 0,
    "runtime.distributed": 0,
    "runtime.failures": 0,
    "runtime.files": 0,
    "runtime.metric_writers": 0,
    "runtime.orbax_layout": 0,
    "runtime.periodic": 0,
    "runtime.preemption": 0,
    "runtime.provenance": 0,
    "runtime.run_logging": 0,
    "runtime.sharding": 0,
    "runtime.workdir_lock": 0,
    # 1: data, calibration math, the models and the optimizer.
    "data": 1,
    "data.array_records": 1,
    "data.augment": 1,
    "data.corruptions": 1,
    "data.datasets": 1,
    "data.datasets.digits": 1,
    "data.datasets.fashion_mnist_local": 1,
    "data.decode_workers": 1,
    "data.device_stage": 1,
    "data.device_stage.decoders": 1,
    "data.device_stage.nvimgcodec": 1,
    "data.device_stage.packed_regions": 1,
    "data.device_stage.reader": 1,
    "data.device_stage.resize": 1,
    "data.fingerprint": 1,
    "data.image_stats": 1,
    "data.folder_source": 1,
    "data.host_stage": 1,
    "data.input_pipeline": 1,
    "data.preprocess": 1,
    "data.readers": 1,
    "data.record_source": 1,
    "data.sources": 1,
    "data.specs": 1,
    "data.split_cache": 1,
    "data.splits": 1,
    "data.tensorflow_optional": 1,
    "data.tfds_source": 1,
    "calibration": 1,
    "calibration.binning": 1,
    "calibration.bootstrap": 1,
    "calibration.conformal": 1,
    "calibration.exact_newton": 1,
    "calibration.figures": 1,
    "calibration.gamma_net": 1,
    "calibration.losses": 1,
    "calibration.metrics": 1,
    "calibration.newton": 1,
    "calibration.parametric": 1,
    "calibration.posthoc": 1,
    "calibration.ranking": 1,
    "calibration.report": 1,
    "calibration.report_files": 1,
    "calibration.surrogates": 1,
    "calibration.temperature": 1,
    "models": 1,
    "models.custom": 1,
    "models.nets": 1,
    "models.registry": 1,
    "optim": 1,
    # 2: the jitted steps (the score they compute is a function passed in).
    "steps": 2,
    # 3: the checkpointed tree of a run (train state, selection state, partial epoch).
    "run_state": 3,
    # 4: training's lowest module: which train step a loss trains with (FL_gamma's bilevel
    # step and its extra batches). The package's __init__ sits with it.
    "training": 4,
    "training.loss_steps": 4,
    # 4: selection: scores, policies, bookkeeping, score files, score sources, the selector.
    "selection": 4,
    "selection.api": 4,
    "selection.bookkeeping": 4,
    "selection.budgets": 4,
    "selection.policies": 4,
    "selection.score_files": 4,
    "selection.scores": 4,
    "selection.score_sources": 4,
    "selection.selector": 4,
    "selection.subsets": 4,
    # 5-7: config: every config field's check (knows every registry); the validation that
    # applies them and the cross-field rules; what a choice implies (read against the
    # validation) and the start-up checks (the workdir, data, OOD set, target runs, stream
    # files, checkpoint room).
    "config": 5,
    "config.schema": 5,
    "config.validation": 6,
    "config.implied": 7,
    "config.preflight": 7,
    # 8-11: the rest of training: what the loop shares (Run, the last good checkpoint); the
    # evaluators (val/test metrics and the report), one epoch's step loop; the set-up (the
    # checks before work, the run's parts, the loop's parts compiled ahead); the loop.
    "training.run": 8,
    "training.evaluation": 9,
    "training.step_loop": 9,
    "training.setup": 10,
    "training.train": 11,
}


def _module_files() -> dict[str, str]:
  """Every module under cpjax/: its name relative to cpjax -> its file."""
  modules = {}
  for folder, dirs, files in os.walk(ROOT):
    dirs[:] = sorted(d for d in dirs if d != "__pycache__")
    parts = os.path.relpath(folder, ROOT).split(os.sep)
    parts = [] if parts == ["."] else parts
    for name in sorted(files):
      if name.endswith(".py"):
        module = parts if name == "__init__.py" else parts + [name[:-3]]
        modules[".".join(module)] = os.path.join(folder, name)
  return modules


MODULES = _module_files()


def _is_package(module: str) -> bool:
  return MODULES.get(module, "").endswith("__init__.py")


def _resolve(absolute: str) -> str | None:
  """'cpjax.data.splits' -> 'data.splits' (relative to cpjax); None outside cpjax."""
  if absolute == PACKAGE:
    return ""
  if absolute.startswith(PACKAGE + "."):
    return absolute[len(PACKAGE) + 1:]
  return None


def _join(package: str, name: str) -> str:
  return f"{package}.{name}" if package else name


def _imported(importer: str, node: ast.Import | ast.ImportFrom) -> list[str]:
  """The cpjax modules that one import statement of `importer` imports (relative to cpjax).

  `from cpjax.x import y` imports module x.y when y is a submodule, else (y is a
  name defined in x) module x. Relative imports are resolved against `importer`.
  """
  if isinstance(node, ast.Import):
    return [m for m in (_resolve(alias.name) for alias in node.names) if m is not None]
  if node.level:  # from . import x, from ..x import y
    package = importer.split(".") if _is_package(importer) else importer.split(".")[:-1]
    package = package[:len(package) - (node.level - 1)] if node.level > 1 else package
    base = ".".join(p for p in package + (node.module or "").split(".") if p)
  else:
    base = _resolve(node.module or "")
    if base is None:
      return []
  targets = []
  for alias in node.names:
    submodule = _join(base, alias.name)
    targets.append(submodule if alias.name != "*" and submodule in MODULES else base)
  return targets


class _ImportVisitor(ast.NodeVisitor):
  """Collects a module's cpjax imports: (target, line, inside a function body)."""

  def __init__(self, importer: str):
    self.importer = importer
    self.depth = 0  # Function / lambda nesting.
    self.imports: list[tuple[str, int, bool]] = []

  def _function(self, node):
    self.depth += 1
    self.generic_visit(node)
    self.depth -= 1

  visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

  def _import(self, node):
    for target in _imported(self.importer, node):
      self.imports.append((target, node.lineno, self.depth > 0))

  visit_Import = visit_ImportFrom = _import

  def visit_Call(self, node):  # importlib.import_module("cpjax.x") / __import__("cpjax.x").
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if (name in ("import_module", "__import__") and node.args
        and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
      target = _resolve(node.args[0].value)
      if target is not None:
        self.imports.append((target, node.lineno, True))  # Dynamic: as lazy as it gets.
    self.generic_visit(node)


def _parse_imports() -> dict[str, list[tuple[str, int, bool]]]:
  imports = {}
  for module, path in MODULES.items():
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read(), filename=path)
    visitor = _ImportVisitor(module)
    visitor.visit(tree)
    imports[module] = visitor.imports
  return imports


IMPORTS = _parse_imports()


def _name(module: str) -> str:
  return _join(PACKAGE, module)


def _where(module: str, line: int) -> str:
  return f"{os.path.relpath(MODULES[module], REPO)}:{line}"


def _package_of(module: str) -> str:
  """The top-level package of a module ('data' for data.datasets.digits); a top-level
  module is a package of its own."""
  return module.split(".")[0]


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One cycle of `graph` as [a, b, ..., a], or None (iterative three-colour DFS)."""
  state = {}  # Absent: unvisited; 1: on the DFS path; 2: done.
  for start in sorted(graph):
    if start in state:
      continue
    path, stack = [start], [iter(sorted(graph[start]))]
    state[start] = 1
    while stack:
      nxt = next(stack[-1], None)
      if nxt is None:
        state[path.pop()] = 2
        stack.pop()
      elif state.get(nxt) == 1:
        return path[path.index(nxt):] + [nxt]
      elif nxt not in state:
        state[nxt] = 1
        path.append(nxt)
        stack.append(iter(sorted(graph.get(nxt, ()))))
  return None


def test_the_checks_see_the_package():
  """Guards against a vacuous pass: the walk finds the modules and their imports."""
  assert {"", "steps", "training.train", "data.datasets.digits"} <= set(MODULES)
  assert ("steps", False) in {(t, lazy) for t, _, lazy in IMPORTS["training.train"]}
  assert "data.datasets" in {t for t, _, _ in IMPORTS["data.input_pipeline"]}  # A package.
  assert "data.splits" in {t for t, _, _ in IMPORTS["data.input_pipeline"]}  # A name in it.


def test_find_cycle_names_the_cycle():
  assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
  assert _find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_every_module_has_a_rank():
  unranked = sorted(_name(m) for m in set(MODULES) - set(RANKS))
  stale = sorted(_name(m) for m in set(RANKS) - set(MODULES))
  assert not unranked, (f"modules with no layer: {unranked}; place each in RANKS of "
                        "tests/test_layering.py (see the package docstrings for the layers)")
  assert not stale, f"RANKS names modules that no longer exist: {stale}"


def test_no_lazy_imports_of_cpjax():
  lazy = [f"{_where(m, line)}: {_name(m)} imports {_name(t)} inside a function"
          for m, imports in sorted(IMPORTS.items()) for t, line, inside in imports if inside]
  assert not lazy, "cpjax imports must be at module level:\n" + "\n".join(lazy)


def test_import_graph_has_no_cycle():
  graph = {m: {t for t, _, _ in imports if t != m} for m, imports in IMPORTS.items()}
  cycle = _find_cycle(graph)
  assert cycle is None, "import cycle: " + " -> ".join(_name(m) for m in cycle)


def test_imports_go_down_the_layers():
  bad = []
  for module, imports in sorted(IMPORTS.items()):
    for target, line, _ in imports:
      if module not in RANKS or target not in RANKS or target == module:
        continue  # Unranked modules fail test_every_module_has_a_rank.
      rank, target_rank = RANKS[module], RANKS[target]
      edge = (f"{_where(module, line)}: {_name(module)} (rank {rank}) imports "
              f"{_name(target)} (rank {target_rank})")
      if target_rank > rank:
        bad.append(f"{edge}: an upward import")
      elif target_rank == rank and _package_of(target) != _package_of(module):
        bad.append(f"{edge}: same rank, another package")
  assert not bad, "layering violations:\n" + "\n".join(bad)


@pytest.mark.parametrize("module", ["", "runtime", "data", "data.device_stage", "calibration",
                                    "selection", "config", "training"])
def test_package_inits_sit_at_their_lowest_module(module):
  members = [r for m, r in RANKS.items() if m != module and m.startswith(_join(module, ""))]
  assert RANKS[module] == min(members)


@pytest.mark.parametrize("package", ["runtime", "data", "calibration", "selection"])
def test_each_package_sits_in_one_layer(package):
  """A package straddling two ranks lets a module between them import its upper half and
  be imported by its lower half (an upward arrow in all but name)."""
  ranks = {m: r for m, r in RANKS.items() if _package_of(m) == package and m}
  assert len(set(ranks.values())) == 1, f"{package} spans ranks {ranks}"
