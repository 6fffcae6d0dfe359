"""nvImageCodec on each device's GPU: the device stage's `gpu` decoder (dataset.decode=gpu).

Run on one GPU, not yet at a steady rate: on one NVIDIA H200, `python -m benchmarks.gpu_runs`
trained a ResNet-50 in bfloat16 on generated 500 x 375 JPEGs through this decoder on the
card's hardware JPEG decoder. Its last epoch trained at 1,603 img/s with dataset.decode=gpu
against 3,778 with the host stage, and the fresh scoring pass over 10,000 images took 27.1 s
against 25.6 s; the runs were too short to reach a steady-state rate, so these numbers show
that the GPU path (the device buffer, the hardware decoder, the stream synchronisation) runs
end to end, not how fast it runs once warm. Written against nvImageCodec 0.9's Python API
(`nvidia.nvimgcodec`: Decoder, Backend, CodeStream.get_sub_code_stream(region=Region(...)),
DecodeParams, as_images, Decoder.decode(srcs, images=..., params=...)). The same calls on a
CPU (`on_gpu=False`: nvImageCodec's CPU backend decoding into a host buffer) are what the
tests run where the library is installed.

The library is imported when this decoder is built (`Decoder`), never on the default path:
it is an optional extra (`pip install 'cpjax[gpu-decode]'`, nvidia-nvimgcodec-cu13 with
nvidia-nvjpeg; nvidia-nvimgcodec-cu12 for CUDA 12), and `problem` says what is missing.

For each device's shard of a batch:

  1. the JPEGs it can read (`gpu_readable`: an RGB or greyscale JPEG ending in its EOI marker)
     get a place in one buffer of the device's memory (a JAX array, `device_resize.bucket`
     long), each its region's h x w x C bytes;
  2. nvImageCodec decodes them on the device's GPU straight into those places (each place
     wrapped as an external image through its `__cuda_array_interface__`): whole images on
     the hardware JPEG decoder where the card has one (found at start-up by decoding a
     generated JPEG with it), else each box alone as a region on the CUDA decoder: the
     cheaper of the two by the rates measured with nvImageCodec 0.9 on an H100 (hardware,
     whole images, 28,484 img/s; CUDA, regions, 17,548; CUDA, whole, 12,415);
  3. the host waits for the decode to finish on its stream (a one-byte copy synchronises
     it) before the device op reads the buffer;
  4. the rest (other formats, CMYK JPEGs, truncated files, anything the GPU returned None
     for) are decoded by PIL on the host and packed after it, counted as fallbacks.

Decoding: EXIF orientation not applied (as PIL does not), sRGB or grey output, fancy (smooth)
chroma upsampling as libjpeg and PIL do it. Nothing is drawn here: the boxes come from the
host stage's draws.
"""

import importlib.util
import io
import threading

import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image

from cpjax.data import decode_workers, device_resize, packed_regions

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

  def decode(self, items, prepared, channels: int, device: jax.Device) -> packed_regions.Decoded:
    """`items` decoded on `device` (module docstring), the unreadable ones by PIL."""
    del prepared
    chosen = [k for k, item in enumerate(items) if gpu_readable(item)]
    if not chosen:
      return packed_regions.with_host_part(items, {}, None, channels, device, {}, fallback=True)
    places = [self._place(items[k], channels) for k in chosen]
    sizes = [p.height * p.width * channels for p in places]
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    length = device_resize.bucket(int(offsets[-1]))
    buffer, views = self._buffer(length, offsets, places, channels, device)
    streams = [self._stream(items[k]) for k in chosen]
    results = self._decoder(device).decode(streams, images=self._nv.as_images(views),
                                           params=self._params)
    part = self._finished(buffer, device)
    placed = {k: packed_regions.Placed(int(o), p.height, p.width, p.x0, p.y0)
              for k, o, p, result in zip(chosen, offsets, places, results) if result is not None}
    return packed_regions.with_host_part(items, placed, part, channels, device, {},
                                         fallback=True)

  def _place(self, item: packed_regions.Item, channels: int) -> packed_regions.Placed:
    """The region nvImageCodec writes for `item`: its whole image or its box."""
    del channels
    if self.whole:
      return packed_regions.Placed(0, item.height, item.width)
    left, top, right, bottom = item.box
    return packed_regions.Placed(0, bottom - top, right - left, left, top)

  def _stream(self, item: packed_regions.Item):
    stream = self._nv.CodeStream(item.data)
    if self.whole:
      return stream
    left, top, right, bottom = item.box
    return stream.get_sub_code_stream(region=self._nv.Region(top, left, bottom, right))

  def _buffer(self, length: int, offsets, places, channels: int, device: jax.Device):
    """The shard's buffer (device memory, or host memory off the GPU) and one view a place."""
    shapes = [(p.height, p.width, channels) for p in places]
    if not self.on_gpu:
      buffer = np.zeros(length, np.uint8)
      return buffer, [buffer[o:o + int(np.prod(s))].reshape(s) for o, s in zip(offsets, shapes)]
    buffer = jnp.zeros((length,), jnp.uint8, device=device)
    buffer.block_until_ready()  # Written by JAX before nvImageCodec writes into it.
    base = buffer.__cuda_array_interface__["data"][0]
    return buffer, [_CudaView(base + int(o), s) for o, s in zip(offsets, shapes)]

  def _finished(self, buffer, device: jax.Device) -> jax.Array:
    """The decoded buffer as a JAX array on `device`, once the decode has finished: on the
    GPU, a one-byte copy to the host on the decode's stream (0) waits for it."""
    if not self.on_gpu:
      return jax.device_put(buffer, device)
    base = buffer.__cuda_array_interface__["data"][0]
    self._nv.as_image(_CudaView(base, (1, 1, 1))).cpu()  # cudaStreamSynchronize(0) inside.
    return buffer
