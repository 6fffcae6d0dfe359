"""nvImageCodec on each device's GPU: the device stage's `gpu` decoder (dataset.decode=gpu).

Run on one NVIDIA H200 on the card's hardware JPEG decoder, a ResNet-50 in bfloat16 on
generated 500 x 375 JPEGs: first in runs too short for a steady rate (an earlier GPU
benchmark's `python main.py`: its last epoch 1,603 img/s with dataset.decode=gpu against 3,778
with the host stage), which showed that the GPU path (the device buffer, the hardware decoder,
the stream synchronisation) runs end to end; then, with the device buffers reused and the
decode on a stream of its own (steps 1 to 3 below), at a steady rate in benchmarks.gpu_check:
1,779 img/s against 6,017 with the host stage (docs/data.md). Written against nvImageCodec
0.9's Python API (`nvidia.nvimgcodec`: Decoder, Backend,
CodeStream.get_sub_code_stream(region=Region(...)), DecodeParams, as_images(..., cuda_stream),
Decoder.decode(srcs, images=..., params=..., cuda_stream=...)). The same calls on a CPU
(`on_gpu=False`: nvImageCodec's CPU backend decoding into a host buffer) are what the tests run
where the library is installed.

The library is imported when this decoder is built (`Decoder`), never on the default path:
it is an optional extra (`pip install 'cpjax[gpu-decode]'`, nvidia-nvimgcodec-cu13 with
nvidia-nvjpeg; nvidia-nvimgcodec-cu12 for CUDA 12), and `problem` says what is missing.

For each device's shard of a batch:

  1. the JPEGs it can read (`gpu_readable`: an RGB or greyscale JPEG ending in its EOI marker)
     get a place in one buffer of the device's memory, each its region's h x w x C bytes: the
     next of the device's buffers of the reader's length (packed_regions.DeviceBuffers: JAX
     arrays allocated once, as many as the batches in flight, each reused once the device op
     that read it has finished), so that no batch waits for an allocation queued behind the
     steps already dispatched to the device;
  2. nvImageCodec decodes them on the device's GPU straight into those places (each place
     wrapped as an external image through its `__cuda_array_interface__`), on a CUDA stream of
     its own (one a device, made with CUDA's driver API: `_Stream`; the library's
     `cuda_stream` arguments), apart from the streams XLA runs the steps on: whole images on
     the hardware JPEG decoder where the card has one (found at start-up by decoding a
     generated JPEG with it), else each box alone as a region on the CUDA decoder: the
     cheaper of the two by the rates measured with nvImageCodec 0.9 on an H100 (hardware,
     whole images, 28,484 img/s; CUDA, regions, 17,548; CUDA, whole, 12,415);
  3. the host waits for that stream (cuStreamSynchronize) before the device op is dispatched
     to read the buffer: the one wait the op needs, as XLA cannot wait on another stream;
  4. the rest (other formats, CMYK JPEGs, truncated files, anything the GPU returned None
     for) are decoded by PIL on the host and packed after it, counted as fallbacks.

Where the stream cannot be made, the decode runs on CUDA's default stream and a one-byte copy
to the host waits for it, as before (logged once).

Decoding: EXIF orientation not applied (as PIL does not), sRGB or grey output, fancy (smooth)
chroma upsampling as libjpeg and PIL do it. Nothing is drawn here: the boxes come from the
host stage's draws.
"""

import ctypes
import dataclasses
import importlib.util
import io
import logging
import threading

import jax
import numpy as np
from PIL import Image

from cpjax.data import decode_workers
from cpjax.data.device_stage import packed_regions, resize

INSTALL = ("pip install 'cpjax[gpu-decode]' (nvidia-nvimgcodec-cu13 and nvidia-nvjpeg; "
           "nvidia-nvimgcodec-cu12 for CUDA 12)")
JPEG_END = b"\xff\xd9"  # The EOI marker: a JPEG without it is truncated (PIL names it).


def problem() -> str | None:
  """Why the gpu decoder cannot run here (an NVIDIA GPU visible to JAX and nvImageCodec
  installed), in one line naming everything to install; None when it can."""
  devices = jax.local_devices()
  missing = ("" if _nvimgcodec_installed() else
             f"needs nvImageCodec, which is not installed: {INSTALL}")
  if not any(_nvidia(d) for d in devices):
    return (f"needs an NVIDIA GPU; JAX's devices here are {sorted({d.platform for d in devices})}"
            " (install jax[cuda13] or jax[cuda12] on a GPU machine)"
            + (f"; it also {missing}" if missing else ""))
  return missing or None


def _nvimgcodec_installed() -> bool:
  try:
    return importlib.util.find_spec("nvidia.nvimgcodec") is not None
  except ModuleNotFoundError:  # No `nvidia` package at all.
    return False


def _nvidia(device: jax.Device) -> bool:
  version = getattr(getattr(device, "client", None), "platform_version", "")
  return device.platform == "gpu" and "cuda" in str(version).lower()


def gpu_readable(item: packed_regions.Item) -> bool:
  """Whether the GPU decoder is given `item`: an RGB or greyscale JPEG that ends in its EOI
  marker. CMYK/YCCK JPEGs (whose colours PIL converts its own way), other formats and
  truncated files go to PIL."""
  return (item.format == "JPEG" and item.mode in ("RGB", "L")
          and item.data.endswith(JPEG_END))


class _CudaView:
  """A place in device memory described by the CUDA array interface (nvImageCodec wraps it
  as an external image and decodes into it)."""

  def __init__(self, pointer: int, shape: tuple[int, ...]):
    self.__cuda_array_interface__ = {"shape": shape, "typestr": "|u1", "strides": None,
                                     "data": (pointer, False), "version": 3}


def _test_jpeg() -> bytes:
  """A generated 256 x 256 baseline JPEG (the hardware decoder's probe)."""
  pixels = np.random.default_rng(0).integers(0, 256, (256, 256, 3), np.uint8)
  out = io.BytesIO()
  Image.fromarray(pixels).save(out, format="JPEG", quality=90)
  return out.getvalue()


class _Stream:
  """A CUDA stream of nvImageCodec's own on the GPU with CUDA ordinal `ordinal` (non-blocking:
  it waits for no other stream), made and synchronised through CUDA's driver API
  (libcuda.so.1, part of the NVIDIA driver) in the device's primary context, the one JAX
  uses. `handle` is the cudaStream_t as an integer, as nvImageCodec's `cuda_stream` takes it."""
  NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING.

  def __init__(self, ordinal: int):
    self._cuda = ctypes.CDLL("libcuda.so.1")
    self._call("cuInit", 0)
    device = ctypes.c_int()
    self._call("cuDeviceGet", ctypes.byref(device), ordinal)
    self._context = ctypes.c_void_p()
    self._call("cuDevicePrimaryCtxRetain", ctypes.byref(self._context), device)
    stream = ctypes.c_void_p()
    self._in_context("cuStreamCreate", ctypes.byref(stream), self.NON_BLOCKING)
    self._stream, self.handle = stream, int(stream.value or 0)

  def _call(self, name: str, *args) -> None:
    status = getattr(self._cuda, name)(*args)
    if status != 0:
      raise RuntimeError(f"{name} failed with CUDA error {status}")

  def _in_context(self, name: str, *args) -> None:
    self._call("cuCtxPushCurrent_v2", self._context)
    try:
      self._call(name, *args)
    finally:
      self._cuda.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))

  def wait(self) -> None:
    """Blocks until the work queued on the stream (the decode) has finished."""
    self._in_context("cuStreamSynchronize", self._stream)


class Decoder:
  """The `gpu` decoder (module docstring). `on_gpu=False`: nvImageCodec's CPU backend into a
  host buffer, then one transfer (the tests' way to run these calls without a GPU)."""

  def __init__(self, channels: int = 3, on_gpu: bool = True):
    # The optional library, imported here, when this decoder is chosen (module docstring).
    from nvidia import nvimgcodec  # pylint: disable=import-outside-toplevel
    self._nv, self.on_gpu = nvimgcodec, on_gpu
    self._params = nvimgcodec.DecodeParams(
        apply_exif_orientation=False,
        color_spec=nvimgcodec.ColorSpec.GRAY if channels == 1 else nvimgcodec.ColorSpec.SRGB)
    kinds = nvimgcodec.BackendKind
    self.hardware = on_gpu and self._decodes(self._new([kinds.HW_GPU_ONLY], None), _test_jpeg())
    self._kinds = ([kinds.HW_GPU_ONLY, kinds.HYBRID_CPU_GPU] if self.hardware
                   else [kinds.HYBRID_CPU_GPU] if on_gpu else [kinds.CPU_ONLY])
    self.whole = self.hardware  # Whole images on the hardware decoder, else boxes as regions.
    self._decoders: dict[int, object] = {}
    self._streams: dict[int, _Stream | None] = {}  # None: CUDA's default stream.
    self._buffers: dict[tuple[int, int], packed_regions.DeviceBuffers] = {}
    self._lock = threading.Lock()
    self.name = (f"gpu (nvImageCodec {nvimgcodec.__version__}, "
                 + ("hardware JPEG decoder, whole images)" if self.hardware else
                    "CUDA decoder, boxes as regions)" if on_gpu else
                    "its CPU backend, boxes as regions)"))

  def _new(self, kinds, device: jax.Device | None):
    nv = self._nv
    device_id = (nv.NVIMGCODEC_DEVICE_CPU_ONLY if not self.on_gpu else
                 nv.NVIMGCODEC_DEVICE_CURRENT if device is None else device.local_hardware_id)
    threads = max(1, decode_workers.usable_cores() // max(1, jax.local_device_count()))
    return nv.Decoder(device_id=device_id, max_num_cpu_threads=threads,
                      backends=[nv.Backend(kind) for kind in kinds],
                      options=":fancy_upsampling=1")

  def _decodes(self, decoder, data: bytes) -> bool:
    try:
      return decoder.decode(self._nv.CodeStream(data), params=self._params) is not None
    except Exception:  # pylint: disable=broad-except  No hardware decoder on this card.
      return False

  def _decoder(self, device: jax.Device):
    with self._lock:  # One decoder a device, made on its first batch.
      key = device.id
      if key not in self._decoders:
        self._decoders[key] = self._new(self._kinds, device)
      return self._decoders[key]

  def prepare(self, item: packed_regions.Item, channels: int) -> None:
    del item, channels  # The host reads the bytes and header only.

  def layouts(self, length: int) -> tuple[tuple[int, ...], ...]:
    """The device part, then the host's (packed_regions.host_length: its fallbacks)."""
    return (length, resize.MIN_BUCKET), (length, length)

  def decode(self, items, prepared, channels: int, device: jax.Device,
             buffers: packed_regions.Buffers) -> packed_regions.Decoded:
    """`items` decoded on `device` (module docstring), the unreadable ones by PIL."""
    del prepared
    chosen = [k for k, item in enumerate(items) if gpu_readable(item)]
    places = [self._place(items[k], channels) for k in chosen]
    offsets = np.concatenate([[0], np.cumsum([p.height * p.width * channels for p in places],
                                             dtype=np.int64)])
    length = resize.fitted(int(offsets[-1]), buffers.length)
    if self.on_gpu:
      buffer, release = self._device_buffers(device, length, buffers.depth).take()
    else:
      buffer, release = np.zeros(length, np.uint8), None
    try:
      results = self._decoded(buffer, offsets, places, [items[k] for k in chosen], channels,
                              device) if chosen else []
      part = buffer if self.on_gpu else jax.device_put(buffer, device)
      placed = {k: packed_regions.Placed(int(o), p.height, p.width, p.x0, p.y0)
                for k, o, p, result in zip(chosen, offsets, places, results)
                if result is not None}
      decoded = packed_regions.with_host_part(items, placed, part, channels, device, {},
                                              fallback=True, length=buffers.length)
    except BaseException:
      if release is not None:
        release(None)
      raise
    return dataclasses.replace(decoded, release=release)

  def _decoded(self, buffer, offsets, places, chosen, channels: int, device: jax.Device):
    """nvImageCodec's results (None where it could not decode) of the `chosen` items decoded
    into their places of `buffer`, once the decode has finished."""
    views = self._views(buffer, offsets, places, channels)
    stream = self._stream(device)
    handle = 0 if stream is None else stream.handle
    results = self._decoder(device).decode(
        [self._code_stream(item) for item in chosen],
        images=self._nv.as_images(views, cuda_stream=handle), params=self._params,
        cuda_stream=handle)
    if stream is not None:
      stream.wait()
    elif self.on_gpu:  # CUDA's default stream: a one-byte copy to the host waits for it.
      base = buffer.__cuda_array_interface__["data"][0]
      self._nv.as_image(_CudaView(base, (1, 1, 1))).cpu()
    return results

  def _stream(self, device: jax.Device) -> _Stream | None:
    """The device's own decode stream (None off the GPU, or where it cannot be made)."""
    if not self.on_gpu:
      return None
    with self._lock:
      if device.id not in self._streams:
        try:
          self._streams[device.id] = _Stream(device.local_hardware_id)
        except (OSError, AttributeError, RuntimeError) as err:
          logging.warning("nvImageCodec decodes on CUDA's default stream on %s: no stream of "
                          "its own could be made (%s).", device, err)
          self._streams[device.id] = None
      return self._streams[device.id]

  def _device_buffers(self, device: jax.Device, length: int,
                      depth: int) -> packed_regions.DeviceBuffers:
    with self._lock:  # One set a device and length, made on its first batch.
      key = (device.id, length)
      if key not in self._buffers:
        self._buffers[key] = packed_regions.DeviceBuffers(length, depth, device)
      return self._buffers[key]

  def _place(self, item: packed_regions.Item, channels: int) -> packed_regions.Placed:
    """The region nvImageCodec writes for `item`: its whole image or its box."""
    del channels
    if self.whole:
      return packed_regions.Placed(0, item.height, item.width)
    left, top, right, bottom = item.box
    return packed_regions.Placed(0, bottom - top, right - left, left, top)

  def _code_stream(self, item: packed_regions.Item):
    stream = self._nv.CodeStream(item.data)
    if self.whole:
      return stream
    left, top, right, bottom = item.box
    return stream.get_sub_code_stream(region=self._nv.Region(top, left, bottom, right))

  def _views(self, buffer, offsets, places, channels: int) -> list:
    """One view of `buffer` (device memory, or host memory off the GPU) a place."""
    shapes = [(p.height, p.width, channels) for p in places]
    if not self.on_gpu:
      return [buffer[o:o + int(np.prod(s))].reshape(s) for o, s in zip(offsets, shapes)]
    base = buffer.__cuda_array_interface__["data"][0]
    return [_CudaView(base + int(o), s) for o, s in zip(offsets, shapes)]
