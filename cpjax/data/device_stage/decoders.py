"""Who decodes an encoded dataset's images (folder, tfds:NAME, their records):
`dataset.decode`, which cpjax.data.input_pipeline.choose reads. The device stage's decoders
are the registry `DECODERS` (a user's registers a `DecoderKind`, docs/extending.md):

  cpu         the host stage (cpjax.data.host_stage): decode, crop, resize and flip on the
              host's cores; the default
  gpu         the device stage with nvImageCodec (`nvimgcodec`): each device decodes its own
              shard of the batch on its GPU (the hardware JPEG decoder where the card has
              one); needs an NVIDIA GPU and the `gpu-decode` extra
  device_cpu  the device stage with PIL decoding on the host standing in for the GPU's
              decoder (packed_regions.HostDecoder): the same batching, boxes, device op and
              sharding, testable on any machine (slower than `cpu`: one thread pool)
  auto        gpu where it can run (an NVIDIA GPU, the library installed, resize=opencv),
              else cpu; the choice is logged (`resolved_decode`)
"""

from collections.abc import Callable
import dataclasses
import logging

import ml_collections

from cpjax import registry
from cpjax.data.device_stage import nvimgcodec, packed_regions, resize


@dataclasses.dataclass(frozen=True)
class DecoderKind:
  """A device-stage decoder (`dataset.decode`)."""
  name: str
  # Why it cannot run here (one line naming what to install), or None.
  problem: Callable[[], str | None]
  create: Callable[[int], packed_regions.ImageDecoder]  # channels -> the decoder.
  doc: str = ""
  settings: tuple[registry.Setting, ...] = ()


HOST_DECODE, AUTO = "cpu", "auto"  # dataset.decode's choices besides the DECODERS.
DECODERS: registry.Registry[DecoderKind] = registry.Registry(
    "image decoder", "dataset", hint=f"{HOST_DECODE} (the host stage), {AUTO}")
DECODERS.register(DecoderKind("gpu", nvimgcodec.problem, nvimgcodec.Decoder,
                              "nvImageCodec on each device's GPU (the gpu-decode extra)"))
DECODERS.register(DecoderKind("device_cpu", lambda: None, packed_regions.HostDecoder,
                              "PIL on the host standing in for the GPU's decoder (tests)"))


def decode_choices() -> list[str]:
  """dataset.decode's valid values."""
  return [HOST_DECODE, AUTO, *DECODERS.names()]


def decoder_problem(decode: str, engine: str) -> str | None:
  """Why decoder `decode` cannot run here for dataset.resize `engine`, or None: its own
  problem (what to install), else the device op's resize rule (resize.resize_problem)."""
  return DECODERS[decode].problem() or resize.resize_problem(engine)


def resolved_decode(dataset: ml_collections.ConfigDict) -> str:
  """dataset.decode with auto resolved, logged: gpu where it can run (`decoder_problem`),
  else cpu."""
  if dataset.decode != AUTO:
    return dataset.decode
  problem = decoder_problem("gpu", dataset.resize)
  chosen = HOST_DECODE if problem else "gpu"
  logging.info("dataset.decode=auto: %s%s.", chosen, f" (gpu {problem})" if problem else
               " (NVIDIA GPU and nvImageCodec found)")
  return chosen
