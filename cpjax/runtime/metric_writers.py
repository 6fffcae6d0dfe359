"""Metric writers without TensorFlow: TensorBoard event files, the log, several at once.

clu's writers (`clu.metric_writers`, clu 0.0.12) import TensorFlow when imported, and GPU
and TPU images leave TensorFlow out, so a run writes its TensorBoard events with
TensorBoard's own record framing and protos (`tensorboard.summary.writer.record_writer`,
what its event-file writer and PyTorch's SummaryWriter use) and builds each summary as
`tf.summary.scalar`, `tf.summary.image` and the HParams plugin do: the same tags, plugins and
tensors, so TensorBoard and its event reader see what they saw before. The interface is
clu's (`write_scalars`, `write_images`, `write_hparams`, `flush`, `close`), in the style of
big_vision's metric writer: small, for what a run writes.

`ProgressReport` is clu's `periodic_actions.ReportProgress` for cpjax's loop (it imports
clu's writers too): steps/s, ETA and uptime at the steps where it reports, on the run's clock.
"""

import abc
from collections.abc import Iterator, Mapping
import contextlib
import io
import itertools
import logging
import os
import socket
import time
from typing import Any

import numpy as np
from PIL import Image
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.plugins.hparams import summary_v2 as hparams_summary
from tensorboard.plugins.image import metadata as image_metadata
from tensorboard.plugins.scalar import metadata as scalar_metadata
from tensorboard.summary.writer.record_writer import RecordWriter
from tensorboard.util import tensor_util

from cpjax.runtime import anatomy, periodic

_FILE_NUMBERS = itertools.count()  # Two writers of one process in one second: two files.


class MetricWriter(abc.ABC):
  """Where a run's scalars, images and hyper-parameters go (clu's MetricWriter methods)."""

  @abc.abstractmethod
  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    """Writes {tag: number} at global step `step`."""

  def write_images(self, step: int, images: Mapping[str, np.ndarray]) -> None:
    """Writes {tag: uint8 [N, H, W, C] or [H, W, C]} at `step`; ignored unless overridden."""
    del step, images

  def write_hparams(self, hparams: Mapping[str, Any]) -> None:
    """Writes the run's flat hyper-parameters once; ignored unless overridden."""
    del hparams

  def flush(self) -> None:
    """Makes everything written so far durable (or raises what a background write met)."""

  def close(self) -> None:
    """Flushes and releases the writer's files."""
    self.flush()


class LoggingWriter(MetricWriter):
  """Every scalar to the INFO log, one line a step, as clu's LoggingWriter formats it."""

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    values = [f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}"
              for k, v in sorted(scalars.items())]
    logging.info("[%d] %s", step, ", ".join(values))

  def write_images(self, step: int, images: Mapping[str, np.ndarray]) -> None:
    logging.info("[%d] Got images: %s.", step, {k: np.shape(v) for k, v in images.items()})

  def write_hparams(self, hparams: Mapping[str, Any]) -> None:
    logging.info("[Hyperparameters] %s", dict(hparams))


def scalar_summary(tag: str, value: float) -> summary_pb2.Summary:
  """`tf.summary.scalar(tag, value)`'s summary: a float32 scalar tensor of the scalars plugin."""
  return summary_pb2.Summary(value=[summary_pb2.Summary.Value(
      tag=tag, tensor=tensor_util.make_tensor_proto(np.float32(value)),
      metadata=scalar_metadata.create_summary_metadata(display_name=None, description=None))])


def image_summary(tag: str, images: np.ndarray) -> summary_pb2.Summary:
  """`tf.summary.image(tag, images, max_outputs=N)`'s summary: a string tensor [width,
  height, PNG of each image] of the images plugin, for uint8 `images` [N, H, W, C]."""
  images = np.asarray(images, np.uint8)
  images = images[None] if images.ndim == 3 else images
  pngs = []
  for image in images:
    buffer = io.BytesIO()
    Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image).save(buffer, "PNG")
    pngs.append(buffer.getvalue())
  height, width = images.shape[1:3]
  tensor = tensor_util.make_tensor_proto(
      np.array([str(width).encode(), str(height).encode(), *pngs], dtype=object))
  return summary_pb2.Summary(value=[summary_pb2.Summary.Value(
      tag=tag, tensor=tensor,
      metadata=image_metadata.create_summary_metadata(display_name=None, description=None))])


class TensorBoardWriter(MetricWriter):
  """A TensorBoard event file in `logdir` (`events.out.tfevents.*`, TFRecord-framed `Event`
  protos through TensorBoard's RecordWriter), written in the caller's thread; the file is
  created by the first event.

  Written in the caller's thread, not a background one as TensorBoard's EventFileWriter
  does: a failed write (a full disk) is then raised where it happens, once, as an OSError
  naming the event file, instead of a thread's traceback on stderr and the error again at
  the next call. A run writes a few events a logging window: the writes are buffered and
  reach the disk at `flush` (each epoch) and `close`.
  """

  def __init__(self, logdir: str):
    self.path = os.path.join(logdir, "events.out.tfevents.%010d.%s.%d.%d.v2" % (
        time.time(), socket.gethostname(), os.getpid(), next(_FILE_NUMBERS)))
    self._records: RecordWriter | None = None  # Opened by the first event: none, no file.

  def _opened(self) -> RecordWriter:
    if self._records is None:
      with self._naming_the_file():
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self._records = RecordWriter(open(self.path, "ab"))  # pylint: disable=consider-using-with
        self._records.write(event_pb2.Event(wall_time=time.time(),
                                            file_version="brain.Event:2").SerializeToString())
    return self._records

  @contextlib.contextmanager
  def _naming_the_file(self) -> Iterator[None]:
    """An OSError inside (no space, a read-only folder) re-raised naming the event file."""
    try:
      yield
    except OSError as err:
      raise OSError(err.errno, f"writing TensorBoard events: {err.strerror or err}",
                    self.path) from err

  def _add(self, step: int, summary: summary_pb2.Summary) -> None:
    event = event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary)
    records = self._opened()
    with self._naming_the_file():
      records.write(event.SerializeToString())

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    for tag, value in scalars.items():
      self._add(step, scalar_summary(tag, value))

  def write_images(self, step: int, images: Mapping[str, np.ndarray]) -> None:
    for tag, value in images.items():
      self._add(step, image_summary(tag, value))

  def write_hparams(self, hparams: Mapping[str, Any]) -> None:
    self._add(0, hparams_summary.hparams_pb(dict(hparams)))

  def flush(self) -> None:
    if self._records is not None:
      with self._naming_the_file():
        self._records.flush()

  def close(self) -> None:
    if self._records is not None and not self._records.closed:
      with self._naming_the_file():
        self._records.close()


class MultiWriter(MetricWriter):
  """Writes to each of `writers` in turn."""

  def __init__(self, writers: list[MetricWriter]):
    self._writers = list(writers)

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    for writer in self._writers:
      writer.write_scalars(step, scalars)

  def write_images(self, step: int, images: Mapping[str, np.ndarray]) -> None:
    for writer in self._writers:
      writer.write_images(step, images)

  def write_hparams(self, hparams: Mapping[str, Any]) -> None:
    for writer in self._writers:
      writer.write_hparams(hparams)

  def flush(self) -> None:
    for writer in self._writers:
      writer.flush()

  def close(self) -> None:
    for writer in self._writers:
      writer.close()


def _format_seconds(seconds: float) -> str:
  minutes, seconds = divmod(int(round(seconds)), 60)
  hours, minutes = divmod(minutes, 60)
  return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s"


class ProgressReport:
  """Steps/s, ETA and uptime every `every_steps` global steps and at the last, as clu's
  ReportProgress reports them (the log line, `steps_per_sec` and `uptime` to `writer`), on the
  run's `clock` (cpjax.runtime.anatomy): its uptime, and the parts its time went to so far.

  Called after every step, it decides where it reports; its first call starts the rate's
  clock (the first step's compile is in no rate), and a rate is (steps since the previous
  report) / (seconds since it).
  """

  def __init__(self, num_train_steps: int, writer: MetricWriter | None, every_steps: int,
               clock: anatomy.RunClock):
    self._num_train_steps, self._writer, self._every_steps = num_train_steps, writer, every_steps
    self._clock = clock
    self._previous: tuple[int, float] | None = None

  def __call__(self, step: int, t: float | None = None) -> bool:
    """Reports at `step` if it is due (a multiple of every_steps, or the last); True if it
    reported. `t`: the clock's seconds now (read from it by default)."""
    if self._previous is not None and (
        not periodic.due_step(step, self._every_steps, self._num_train_steps)
        or step == self._previous[0]):
      return False
    t = time.time() - self._clock.start if t is None else t
    if self._previous is None:
      self._previous = (step, t)
      return False
    steps_per_sec = (step - self._previous[0]) / (t - self._previous[1])
    self._previous = (step, t)
    self._report(step, steps_per_sec, t)
    return True

  def _report(self, step: int, steps_per_sec: float, uptime: float) -> None:
    message = f"{steps_per_sec:.1f} steps/s"
    if self._num_train_steps:
      eta = (self._num_train_steps - step) / steps_per_sec
      message += (f", {100 * step / self._num_train_steps:.1f}% ({step}/"
                  f"{self._num_train_steps}), ETA: {_format_seconds(eta)}")
    largest = sorted(self._clock.parts().items(), key=lambda item: -item[1])[:3]
    message += " ({} : {})".format(_format_seconds(uptime), ", ".join(
        f"{100 * s / max(uptime, 1e-9):.1f}% {name.replace('_', ' ')}" for name, s in largest))
    logging.info("Progress: %s", message)
    if self._writer is not None:
      self._writer.write_scalars(step, {"steps_per_sec": steps_per_sec, "uptime": uptime})
