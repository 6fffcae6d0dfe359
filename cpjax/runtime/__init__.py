"""The runtime layer: device mesh, multi-host start-up, checkpoints, logs, XLA options.

The lowest layer of cpjax: it knows nothing about data, losses or selection,
and every other package may import it.
"""
