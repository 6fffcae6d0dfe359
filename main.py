"""Trains and evaluates a cpjax config: the command-line entry point.

  python main.py --config=configs/default.py --workdir=/tmp/cpjax
  python main.py --config=configs/default.py --workdir=/tmp/cpjax --config.num_epochs=5
  python main.py --config=configs/default.py --workdir=/tmp/cpjax --mode=evaluate

Rerunning the same command resumes from the latest checkpoint in --workdir. A choice sets
what it needs unless the command line or the config file sets it (logged): e.g.
--config.selection.method=infobatch implies --config.selection.score=loss, and
--config.selection.budget=0.5 sets the kept fraction that trains half of full data's example
passes on the config's schedule (cpjax.selection.budgets). A bad config
(or a missing --config file or flag) prints its problems and exits with status 2 (a usage
error), as does a run refused before it starts: its start-up checks (data not prepared, no
room for a checkpoint), a workdir in use by another run, a dataset changed under its
checkpoint.
--config.import_modules=mypkg.extras imports a user's module first (before the config file
is read), so the policies, datasets, models... it registers are choices like cpjax's own
(docs/extending.md).
An operational failure (a full or read-only folder, a failed checkpoint write, a lost
process, a damaged image, a full /dev/shm), and a run that diverges or learns nothing, end in
one FATAL line naming the cause, the way out and the last good checkpoint, and status 1
(cpjax/runtime/failures.py). A run stopped by SIGTERM or Ctrl-C saves a checkpoint and exits
with status 75; a further signal changes nothing (docs/reliability.md).
On a cluster, jax.distributed is started first (see cpjax/runtime/distributed.py).
"""

import importlib.util
import logging as std_logging
import os
import re
import signal
import sys

# TensorFlow is optional and never imported for training; where it is installed and something
# imports it (building a tfds catalog dataset), its INFO lines and oneDNN notice are quieted.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

from absl import app, flags, logging
import jax
from ml_collections import config_flags

from configs import default
from cpjax.config import implied, preflight, schema, validation
from cpjax.data import decode_workers, fingerprint
from cpjax.runtime import checkpointing, distributed, failures, preemption, workdir_lock
from cpjax.training import train

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Path to a config file.", lock_config=True)
flags.DEFINE_string("workdir", None, "Directory for checkpoints, logs and metrics.")
flags.DEFINE_enum("mode", "train", ["train", "evaluate"],
                  "train (resumes if --workdir has checkpoints), or evaluate: write "
                  "--workdir/report for the latest checkpoint without training.")
flags.DEFINE_string("coordinator_address", None,
                    "host:port of process 0, for clusters jax cannot auto-detect.")
flags.DEFINE_integer("num_processes", None, "Number of processes (with --coordinator_address).")
flags.DEFINE_integer("process_id", None, "This process's index (with --coordinator_address).")
flags.DEFINE_integer("heartbeat_timeout_s", distributed.HEARTBEAT_TIMEOUT_S,
                     "Multi-process runs: seconds after which a silent (dead) process is "
                     "declared lost and the others exit with an error instead of waiting.")
flags.mark_flags_as_required(["config", "workdir"])
# Exit status of a run refused before it starts: a bad command line or config (as absl's and
# argparse's), failed start-up checks, a busy workdir, a dataset changed under its checkpoint.
USAGE_ERROR = 2


def _quiet_library_info(record: std_logging.LogRecord) -> bool:
  """Keeps warnings and cpjax's own lines; drops orbax's per-save INFO lines, its warning
  that a target run's checkpoints are opened read-only (cpjax asks for that), its tracebacks
  of a write that a full or read-only folder refused (each of its writing threads logs one;
  the error reaches the save's caller, and the run's FATAL line names it), and JAX's INFO
  probe for absent backends ("Unable to initialize backend 'tpu'") on CPU/GPU machines."""
  from_orbax = "/orbax/" in record.pathname
  if from_orbax and record.getMessage().startswith("Given directory is read only"):
    return False
  if from_orbax and record.exc_info and record.exc_info[1] is not None and (
      failures.storage_error(record.exc_info[1]) is not None):
    return False
  if record.levelno >= std_logging.WARNING:
    return True
  return not from_orbax and not record.pathname.endswith("xla_bridge.py")


def _quiet_closed_loop_callbacks(unraisable) -> None:
  """`sys.unraisablehook`, dropping one kind of noise to the debug log: after a checkpoint
  write that a full or read-only folder refused, tensorstore completes the save's other
  writes into orbax's event loop, already closed, and each completion raises "Event loop is
  closed" where no caller can catch it (a traceback each, before the FATAL line). The
  refused write itself reaches the save's caller and the FATAL line names it. Every other
  unraisable exception goes to Python's hook."""
  error = unraisable.exc_value
  if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
    logging.debug("A write's completion into a closed event loop, dropped: %r",
                  unraisable.object)
    return
  sys.__unraisablehook__(unraisable)


def main(argv):
  if len(argv) > 1:
    _usage_exit(f"unexpected arguments {argv[1:]}: every setting is a flag, e.g. "
                "--config.num_epochs=4")
  logging.get_absl_handler().addFilter(_quiet_library_info)
  sys.unraisablehook = _quiet_closed_loop_callbacks
  distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id,
                         FLAGS.heartbeat_timeout_s, FLAGS.workdir)
  config = _config_with_implied_settings()
  logging.info("JAX process %d / %d; local devices: %s", jax.process_index(),
               jax.process_count(), jax.local_devices())
  try:
    if FLAGS.mode == "train":
      train.train_and_evaluate(config, FLAGS.workdir)
    else:
      train.evaluate_only(config, FLAGS.workdir)
  except preemption.Preempted:  # Checkpoint saved and logged: exit so the scheduler requeues.
    for signum in (signal.SIGINT, signal.SIGTERM):  # The stop's line stays the last.
      signal.signal(signum, signal.SIG_IGN)
    distributed.finished()
    sys.exit(preemption.EXIT_CODE)
  # Refused before the run starts, as a bad config is (status 2, one line per problem, no
  # traceback): the start-up checks, a busy workdir, a dataset folder (or its records)
  # changed under its checkpoint.
  except (preflight.StartupCheckError, workdir_lock.WorkdirLockedError,
          fingerprint.DatasetChangedError) as err:
    _usage_exit(str(err))
  except Exception as err:  # pylint: disable=broad-except  (a bug re-raises below)
    _exit_on_failure(err)
    raise
  distributed.finished()


def _exit_on_failure(err: Exception) -> None:
  """Ends the process with one FATAL line if `err` is an operational failure (a failed
  checkpoint write, a full or read-only folder, a lost process, an error that names its own
  way out: a dead decoding worker, a full /dev/shm, a damaged image) or a run that diverged or
  learns nothing (its error names the last good checkpoint and what to change); returns for a
  bug."""
  checkpoint_dir = os.path.join(os.path.abspath(FLAGS.workdir), "checkpoints")
  if isinstance(err, (checkpointing.CheckpointSaveError, train.NonFiniteLossError,
                      train.StalledTrainingError)):
    line = " ".join(str(err).split())
  elif failures.cause(err, jax.process_count()) != failures.OTHER:
    line = failures.line(err, checkpoint_dir, jax.process_count())
  else:
    return
  if failures.is_lost_peer(err, jax.process_count()):
    distributed.await_lost_process()  # The liveness watch names the lost process and exits.
  # os._exit skips the interpreter's clean-up: the decoding workers' queues and shared
  # memory are released first, or the resource tracker reports them after the FATAL line.
  decode_workers.close_all()
  print(f"FATAL {line}", file=sys.stderr, flush=True)
  # After a failed write orbax's background threads may never end, and a normal exit waits
  # for them (the process would hang, holding its allocation): end it now. The workdir
  # lock is released with the process.
  os._exit(1)


def _config_with_implied_settings():
  """--config with what its choices imply set (logged), validated: a bad one exits with its
  problems alone. Set by the user: the command-line overrides and the fields the config file
  changed from configs/default.py."""
  try:
    validation.import_modules(FLAGS.config)  # A user's registrations, before all else.
  except validation.ConfigError as err:
    _usage_exit(str(err))
  explicit = implied.user_set(FLAGS["config"].override_values,
                              implied.changed_fields(FLAGS.config, default.get_config()))
  settings = implied.implied_settings(FLAGS.config, explicit)
  for name, (value, reason) in settings.items():
    logging.info("Implied config.%s=%r: %s (set --config.%s to choose otherwise).", name,
                 value, reason, name)
  config = implied.with_settings(FLAGS.config, {k: v for k, (v, _) in settings.items()})
  try:
    budget, line = implied.budget_settings(config, explicit)  # Once, here: then logged.
    if line:
      logging.info("%s", line)
    config = implied.with_settings(config, budget)
    validation.validate(config)
  except validation.ConfigError as err:
    _usage_exit(str(err))
  return config


def _usage_exit(message: str):
  print(f"FATAL {message}", file=sys.stderr)
  sys.exit(USAGE_ERROR)


def _load_config(path: str):
  """`get_config()` of a config file, as --config loads it (absl leaves it unset on errors)."""
  spec = importlib.util.spec_from_file_location("_cpjax_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def _flag_value(argv: list[str], name: str) -> str | None:
  """The value of `--name=value` or `--name value` in argv (the last one), else None."""
  value = None
  for i, arg in enumerate(argv):
    if arg.startswith(f"--{name}="):
      value = arg.split("=", 1)[1]
    elif arg == f"--{name}" and i + 1 < len(argv):
      value = argv[i + 1]
  return value


def _check_config_file(value: str) -> None:
  """Exits with one line (status 2) if the file of `--config=PATH[:ARGS]` is not there;
  ml_collections would otherwise fail later with a traceback and status 1."""
  path = value.split(":", 1)[0]
  if os.path.isfile(path):
    return
  configs = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
  names = sorted(n for n in os.listdir(configs) if n.endswith(".py") and n != "__init__.py")
  _usage_exit(f"--config file {path!r} does not exist (or is not a file); the configs in "
              f"{configs}: {', '.join(names)}")


def _flag_error_line(err: Exception) -> str:
  """absl's error about the command line's flags as one line: the required flags that are
  missing, named with the command that sets them, or absl's own message."""
  missing = re.findall(r"Flag --(\w+) must have a value other than None", str(err))
  if missing:
    return (f"{' and '.join('--' + name for name in missing)} "
            f"{'is' if len(missing) == 1 else 'are'} required: python main.py "
            "--config=configs/default.py --workdir=DIR (any file of configs/, any folder for "
            "the run's checkpoints, logs and report)")
  return (f"Flags parsing error: {' '.join(str(err).split())} (python main.py --helpshort "
          "lists the flags)")


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with a missing --config file or an unknown `--config.FIELD`
  reported as a one-line error."""
  config_path = _flag_value(argv, "config")
  if config_path is not None:
    _check_config_file(config_path)
  modules = _flag_value(argv, "config.import_modules")
  if modules:  # Before the config file is read: configs/default.py adds their settings.
    problem = schema.import_problem(modules)
    if problem:
      _usage_exit(f"--config.import_modules: {problem}")
  try:
    return FLAGS(argv)
  except flags.Error as err:  # A missing required flag, an unknown flag, a bad flag value.
    _usage_exit(_flag_error_line(err))
  except (AttributeError, KeyError) as err:  # ml_collections: the override's field is unknown.
    overrides = [a.split("=", 1)[0][len("--config."):] for a in argv if a.startswith("--config.")]
    config_path = _flag_value(argv, "config")
    if config_path is None:
      raise
    config = _load_config(config_path)
    unknown = [name for name in overrides if not schema.has_field(config, name)]
    if not unknown:
      raise
    message = schema.unknown_field_message(config, unknown[0])
    print(f"FATAL Flags parsing error: {message} ({err})", file=sys.stderr)
    sys.exit(USAGE_ERROR)


if __name__ == "__main__":
  jax.config.config_with_absl()
  app.run(main, flags_parser=parse_flags)
