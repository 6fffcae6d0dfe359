"""pyproject.toml declares every third-party distribution that `import cpjax.*` and
`python main.py` import, and nothing it cannot account for; requirements.txt pins them all.

The imports are read with `ast` from the source (every `import`, also inside functions), so a
new import without a declared dependency fails here rather than in a user's fresh venv.
"""

import ast
import importlib.metadata
import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Import name -> distribution name, where they differ or the distribution may be absent here.
DISTRIBUTION_OF = {
    "absl": "absl-py", "array_record": "array-record", "clu": "clu",
    "cv2": "opencv-python-headless", "etils": "etils", "flax": "flax", "grain": "grain",
    "jax": "jax", "matplotlib": "matplotlib",
    "ml_collections": "ml-collections", "numpy": "numpy", "nvidia": "nvidia-nvimgcodec-cu13",
    "optax": "optax",
    "orbax": "orbax-checkpoint", "PIL": "pillow", "scipy": "scipy", "sklearn": "scikit-learn",
    "tensorflow": "tensorflow-cpu", "tensorflow_datasets": "tensorflow-datasets",
    "tensorboard": "tensorboard", "threadpoolctl": "threadpoolctl",
    "yaml": "pyyaml",
}
# Declared but not imported by cpjax, each with the reason it must be installed.
NOT_IMPORTED = {
    "importlib-resources": "tensorflow-datasets imports it for its built-in builders",
}
# Imported only where an optional feature needs it: declared as the pyproject extra named
# here and pinned in the requirements file named here, not in the dependencies.
OPTIONAL = {"tensorflow": ("tf", "requirements-tf.txt"),
            "nvidia": ("gpu-decode", "requirements-gpu-decode.txt")}


def _normalized(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def _top_level_imports(paths) -> dict[str, set[str]]:
  """Third-party top-level module names -> the files importing them."""
  found = {}
  for path in paths:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
      elif isinstance(node, ast.ImportFrom) and node.level == 0:
        names = [node.module]
      else:
        continue
      for name in names:
        top = name.split(".")[0]
        if top not in sys.stdlib_module_names and top not in ("cpjax", "configs"):
          found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
  return found


def _package_imports() -> dict[str, set[str]]:
  return _top_level_imports([*sorted((ROOT / "cpjax").rglob("*.py")), ROOT / "main.py"])


def _declared() -> set[str]:
  with open(ROOT / "pyproject.toml", "rb") as f:
    dependencies = tomllib.load(f)["project"]["dependencies"]
  return {_normalized(re.match(r"[A-Za-z0-9._-]+", d).group(0)) for d in dependencies}


def test_the_import_scan_sees_known_imports():
  imports = _package_imports()
  assert "cpjax/data/array_records.py" in imports["grain"]
  assert "cpjax/calibration/figures.py" in imports["matplotlib"]  # Imported inside a function.
  assert "main.py" in imports["absl"]
  assert not {"os", "json", "cpjax"} & set(imports)


def test_every_import_has_a_known_distribution():
  unknown = sorted(set(_package_imports()) - set(DISTRIBUTION_OF))
  assert not unknown, f"add these imports to DISTRIBUTION_OF (and pyproject.toml): {unknown}"


def test_distribution_table_agrees_with_the_installed_metadata():
  installed = importlib.metadata.packages_distributions()
  for module, distribution in DISTRIBUTION_OF.items():
    if module in installed:
      assert _normalized(distribution) in {_normalized(d) for d in installed[module]}, module


def _extras() -> dict[str, set[str]]:
  with open(ROOT / "pyproject.toml", "rb") as f:
    extras = tomllib.load(f)["project"].get("optional-dependencies", {})
  return {name: {_normalized(re.match(r"[A-Za-z0-9._-]+", d).group(0)) for d in deps}
          for name, deps in extras.items()}


def test_optional_imports_are_declared_as_their_extra_and_pinned_in_their_file():
  for module, (extra, requirements) in OPTIONAL.items():
    distribution = _normalized(DISTRIBUTION_OF[module])
    assert distribution in _extras()[extra] and distribution not in _declared(), module
    assert re.search(rf"^{DISTRIBUTION_OF[module]}==", (ROOT / requirements).read_text(),
                     re.M), module


def test_pyproject_declares_every_imported_distribution():
  needed = {_normalized(DISTRIBUTION_OF[m]): files for m, files in _package_imports().items()
            if m in DISTRIBUTION_OF and m not in OPTIONAL}
  missing = {d: sorted(f) for d, f in needed.items() if d not in _declared()}
  assert not missing, f"imported but not in pyproject.toml's dependencies: {missing}"


def test_pyproject_declares_nothing_unaccounted_for():
  imported = {_normalized(DISTRIBUTION_OF[m]) for m in _package_imports()
              if m in DISTRIBUTION_OF and m not in OPTIONAL}
  extra = _declared() - imported - {_normalized(d) for d in NOT_IMPORTED}
  assert not extra, f"declared, neither imported nor listed in NOT_IMPORTED: {sorted(extra)}"


def test_requirements_pin_every_declared_distribution():
  pinned = {_normalized(m.group(1)) for m in re.finditer(
      r"^([A-Za-z0-9._-]+)(?:\[[^\]]*\])?==", (ROOT / "requirements.txt").read_text(), re.M)}
  unpinned = sorted(_declared() - pinned)
  assert not unpinned, f"pyproject.toml dependencies without a pin in requirements.txt: {unpinned}"


def test_every_line_of_the_optional_requirement_files_is_pinned():
  """An extra's requirements file pins all it installs (nvImageCodec and nvJPEG together),
  as requirements.txt does."""
  for _, requirements in OPTIONAL.values():
    lines = [line.split("#")[0].strip() for line in (ROOT / requirements).read_text().splitlines()]
    unpinned = [line for line in lines if line and "==" not in line]
    assert not unpinned, f"{requirements}: {unpinned}"
