"""Registries of named entries (selection policies, scores, losses) and their declared settings.

An entry is a small frozen dataclass registered once, in the module that defines its
function; it declares its config settings beside it (`Setting`: the field name, default,
check and a one-line doc). Config validation, configs/default.py's fields, the
did-you-mean messages for unknown names and the docs' option tables are all read from
the registries, so a new policy, score or loss is one function and its registration
(docs/extending.md). Checks return a problem description, or None.
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


def integer(low: int | None = None, high: int | None = None) -> Check:
  """An int in [low, high]."""
  def check(value):
    if not is_int(value):
      return f"must be an int, got {value!r} ({type(value).__name__})"
    if (low is not None and value < low) or (high is not None and value > high):
      return f"must be in [{low}, {high}], got {value}"
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
      return (f"must be in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}, "
              f"got {value}")
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
  """Named entries of one kind, in registration order."""

  def __init__(self, kind: str, section: str):
    self.kind, self.section = kind, section  # E.g. "selection policy", "selection".
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
      raise ValueError(f"unknown {self.kind} {name!r}; {did_you_mean(name, self.names())}"
                       f"valid choices: {', '.join(sorted(self.names()))}")
    return self._entries[name]

  def __contains__(self, name: object) -> bool:
    return name in self._entries

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
    return choice(self.names)


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
