"""The device stage: images decoded on each device, cropped, resized and flipped there.

`reader` is the stage's reader (registered in cpjax.data.readers.READERS when imported:
cpjax.data.input_pipeline imports it), `decoders` the registry of who decodes, `resize` the
jitted crop, resize and flip, `packed_regions` the packed buffers and the host's stand-in
decoder, and `nvimgcodec` the GPU decoder (nvImageCodec). This file imports none of them.
"""
