"""When a periodic action is due: the one rule of the loop's evaluations and checkpoints (by
epoch), its logging points and its progress reports (by step)."""


def due_step(step: int, every: int, last: int | None = None) -> bool:
  """Whether a periodic action is due at 1-indexed `step` (or count of epochs done): at every
  multiple of `every` and at the `last`, if given (big_vision's `itstime`)."""
  return step % every == 0 or step == last


def due(epoch: int, every: int, num_epochs: int) -> bool:
  """Whether a periodic action (eval, checkpoint) runs after 0-indexed `epoch`: every
  `every` epochs and always after the last."""
  return due_step(epoch + 1, every, num_epochs)
