"""Registries of named entries and their declared settings: cpjax's one way to add a choice.

Every named choice is an entry of a `Registry`: selection policies and scores, losses,
models, dataset source kinds, host-stage training crops, post-hoc maps and conformal scores.
An entry is a small frozen dataclass with a `name`, a one-line `doc` and the config
`settings` it reads (`Setting`: the field name, default, check and a one-line doc; most
kinds declare none), registered once, in the module that defines its function, or in a
user's own module (`config.import_modules`, docs/extending.md). Config validation,
configs/default.py's fields, the did-you-mean messages for unknown names and the docs'
option tables are all read from the registries, so a new entry is one function and its
registration. Checks return a problem description, or None.
"""

from collections.abc import Callable, Iterator, Sequence
import contextlib
import dataclasses
import difflib
import math
from typing import Any, Generic, Protocol, TypeVar

Check = Callable[[Any], str | None]  # Returns a problem description, or None.


def is_int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _range_text(low: float | None, high: float | None, low_open: bool = False,
                high_open: bool = False) -> str:
  """The allowed range in words where it has one end ("at least 1", "below 1.0"), else as
  an interval ("in [0.0, 1.0)")."""
  if high is None:
    return f"{'above' if low_open else 'at least'} {low}"
  if low is None:
    return f"{'below' if high_open else 'at most'} {high}"
  return f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"


def integer(low: int | None = None, high: int | None = None) -> Check:
  """An int in [low, high] (None: no bound)."""
  def check(value):
    if not is_int(value):
      return f"must be an int, got {value!r} ({type(value).__name__})"
    if (low is not None and value < low) or (high is not None and value > high):
      return f"must be {_range_text(low, high)}, got {value}"
    return None
  return check


def number(low: float | None = None, high: float | None = None,
           low_open: bool = False, high_open: bool = False) -> Check:
  """A finite float (ints accepted) in [low, high]; low_open/high_open exclude the ends."""
  def check(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      return f"must be a number, got {value!r} ({type(value).__name__})"
    if not math.isfinite(value):
      return f"must be finite, got {value}"
    below = low is not None and (value <= low if low_open else value < low)
    above = high is not None and (value >= high if high_open else value > high)
    if below or above:
      return f"must be {_range_text(low, high, low_open, high_open)}, got {value}"
    return None
  return check


def boolean() -> Check:
  return lambda v: None if isinstance(v, bool) else f"must be True or False, got {v!r}"


def string() -> Check:
  return lambda v: None if isinstance(v, str) else f"must be a string, got {v!r}"


def did_you_mean(value: Any, options: Sequence[str]) -> str:
  """"did you mean x? " for the closest of `options` to a string `value`, else ""."""
  close = difflib.get_close_matches(value, list(options), n=2) if isinstance(value, str) else []
  return f"did you mean {' or '.join(close)}? " if close else ""


def choice(options: Sequence[str] | Callable[[], Sequence[str]]) -> Check:
  """One of `options` (or of what the callable returns when the check runs: a registry's
  names, which a test may extend after the schema is built)."""
  def check(value):
    valid = options() if callable(options) else options
    if value not in valid:
      return (f"got {value!r}; {did_you_mean(value, valid)}"
              f"valid choices: {', '.join(sorted(valid))}")
    return None
  return check


def int_sequence(low: int = 0) -> Check:
  """A tuple/list of ints >= low, in increasing order."""
  def check(value):
    if not isinstance(value, (tuple, list)) or not all(is_int(v) for v in value):
      return f"must be a tuple of ints, got {value!r}"
    if any(v < low for v in value) or list(value) != sorted(value):
      return f"must be increasing ints >= {low}, got {value!r}"
    return None
  return check


def floats(length: int | None, low: float, high: float, increasing: bool = False) -> Check:
  """A tuple of numbers in [low, high] (`length` of them, any when None; empty allowed only
  when `length` is None), optionally non-decreasing."""
  def check(value):
    if not isinstance(value, (tuple, list)) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
      return f"must be a tuple of numbers, got {value!r}"
    if length is not None and len(value) != length:
      return f"must hold {length} numbers, got {value!r}"
    if any(not low <= v <= high for v in value):
      return f"must hold numbers in [{low}, {high}], got {value!r}"
    if increasing and list(value) != sorted(value):
      return f"must be (low, high) with low <= high, got {value!r}"
    return None
  return check


@dataclasses.dataclass(frozen=True)
class Setting:
  """One config field that an entry reads: `config.<section>.<name>`.

  Entries that share a field (two losses with one weight) share one Setting object.
  """
  name: str  # The config field, in the registry's config section.
  default: Any  # Its value in configs/default.py.
  check: Check  # Problem description of a bad value, or None.
  doc: str  # One line: what it does (the docs' tables and configs/default.py).
  arg: str | None = ""  # The entry function's keyword; "" = `name`; None = not passed.

  @property
  def keyword(self) -> str | None:
    return self.name if self.arg == "" else self.arg


class Entry(Protocol):
  name: str
  settings: tuple[Setting, ...]
  doc: str


E = TypeVar("E", bound=Entry)


class Registry(Generic[E]):
  """Named entries of one kind, in registration order.

  `register(entry)` adds one (`registered(entry)` for a `with` block); `registry[name]` looks
  one up, and an unknown name raises ValueError naming it, the closest registered names and
  every valid choice; iterating gives the names.
  """

  def __init__(self, kind: str, section: str, hint: str = ""):
    self.kind, self.section = kind, section  # E.g. "selection policy", "selection".
    self.hint = hint  # Appended to the valid choices of an unknown name: what else is valid.
    self._entries: dict[str, E] = {}

  def register(self, entry: E) -> E:
    """Adds `entry`; a taken name, or a setting name taken by a different Setting, raises."""
    if entry.name in self._entries:
      raise ValueError(f"{self.kind} {entry.name!r} is already registered")
    known = {s.name: s for s in self.settings()}
    for setting in entry.settings:
      if setting.name in known and known[setting.name] != setting:
        raise ValueError(f"{self.kind} {entry.name!r} declares setting {setting.name!r}, "
                         f"which another entry declares differently: share one Setting")
    self._entries[entry.name] = entry
    return entry

  def unregister(self, name: str) -> None:
    del self._entries[name]

  @contextlib.contextmanager
  def registered(self, entry: E) -> Iterator[E]:
    """`entry` registered for the `with` block only (tests)."""
    self.register(entry)
    try:
      yield entry
    finally:
      self.unregister(entry.name)

  def __getitem__(self, name: str) -> E:
    if name not in self._entries:
      raise ValueError(f"unknown {self.kind} {name!r}; {self.choices(name)}")
    return self._entries[name]

  def get(self, name: str, default: E | None = None) -> E | None:
    return self._entries.get(name, default)

  def choices(self, name: Any) -> str:
    """"did you mean x? valid choices: a, b[, hint]": what to tell a user who gave `name`."""
    return (f"{did_you_mean(name, self.names())}valid choices: "
            f"{', '.join(sorted(self.names()))}{', ' + self.hint if self.hint else ''}")

  def __contains__(self, name: object) -> bool:
    return name in self._entries

  def __iter__(self) -> Iterator[str]:
    return iter(tuple(self._entries))

  def __len__(self) -> int:
    return len(self._entries)

  def names(self) -> tuple[str, ...]:
    return tuple(self._entries)

  def entries(self) -> tuple[E, ...]:
    return tuple(self._entries.values())

  def items(self):
    return self._entries.items()

  def settings(self) -> tuple[Setting, ...]:
    """Every entry's settings, each shared one once, in registration order."""
    unique = {}
    for entry in self._entries.values():
      for setting in entry.settings:
        unique.setdefault(setting.name, setting)
    return tuple(unique.values())

  def defaults(self) -> dict[str, Any]:
    """{setting name: default}: the registry's fields of configs/default.py."""
    return {s.name: s.default for s in self.settings()}

  def checks(self) -> dict[str, Check]:
    """{"<section>.<setting>": check}: the registry's part of the config schema."""
    return {f"{self.section}.{s.name}": s.check for s in self.settings()}

  def keywords(self, name: str, section: Any) -> dict[str, Any]:
    """Entry `name`'s keyword arguments, read from its settings' fields of `section`."""
    return {s.keyword: section[s.name] for s in self[name].settings if s.keyword is not None}

  def check(self) -> Check:
    """The check of the field that names an entry (one of the names registered when it runs)."""
    def check(value):
      return None if value in self.names() else f"got {value!r}; {self.choices(value)}"
    return check


def markdown_table(registry: Registry, columns: dict[str, Callable[[Any], str]]) -> str:
  """A Markdown table of `registry`: name, doc, settings (name = default: doc), `columns`."""
  header = ["name", *columns, "what it is", "settings (`" + registry.section + ".*`)"]
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  for entry in registry.entries():
    settings = "<br>".join(f"`{s.name}={s.default!r}`: {s.doc}" for s in entry.settings)
    cells = [f"`{entry.name}`", *(fn(entry) for fn in columns.values()), entry.doc,
             settings or "none"]
    lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
  return "\n".join(lines)
