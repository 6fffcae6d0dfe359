"""Compares two runs' metrics.jsonl field by field, leaving out wall-clock fields.

  python -m scripts.compare_metrics RUN_A/metrics.jsonl RUN_B/metrics.jsonl [--rtol 0]

Prints each field that differs (epoch, field, both values, relative difference)
and a one-line verdict; exits 0 if every non-timing field is equal (bit for bit
with the default --rtol 0), 1 otherwise. Used to show that a refactor changed
no number, and that a resumed run reproduces an uninterrupted one.
"""

import argparse
import json
import math
import sys


def _records(path: str) -> dict[int, dict]:
  with open(path) as f:
    return {r["epoch"]: r for r in map(json.loads, filter(str.strip, f))}


def _is_timing(field: str) -> bool:
  return field.endswith("_seconds")


def _is_nan(value) -> bool:
  # Older versions wrote a non-finite metric as NaN; now it is null: both mean "no number".
  return value is None or (isinstance(value, float) and math.isnan(value))


def _equal(a, b, rtol: float) -> bool:
  if _is_nan(a) and _is_nan(b):
    return True
  if isinstance(a, float) and isinstance(b, float):
    return a == b or abs(a - b) <= rtol * max(abs(a), abs(b))
  return a == b


def compare(path_a: str, path_b: str, rtol: float = 0.0) -> list[str]:
  """The differences between two metrics.jsonl files, one line each (empty if none)."""
  a, b = _records(path_a), _records(path_b)
  if sorted(a) != sorted(b):
    return [f"epochs differ: {sorted(a)} vs {sorted(b)}"]
  problems = []
  for epoch in sorted(a):
    fields = sorted((set(a[epoch]) | set(b[epoch])) - {f for f in a[epoch] if _is_timing(f)}
                    - {f for f in b[epoch] if _is_timing(f)})
    for field in fields:
      x, y = a[epoch].get(field, "<absent>"), b[epoch].get(field, "<absent>")
      if not _equal(x, y, rtol):
        rel = (f" (rel {abs(x - y) / max(abs(x), abs(y)):.2e})"
               if isinstance(x, float) and isinstance(y, float) else "")
        problems.append(f"epoch {epoch} {field}: {x!r} vs {y!r}{rel}")
  return problems


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("a")
  parser.add_argument("b")
  parser.add_argument("--rtol", type=float, default=0.0, help="0 = bit for bit.")
  args = parser.parse_args()
  problems = compare(args.a, args.b, args.rtol)
  a = _records(args.a)
  num_fields = len({f for r in a.values() for f in r if not _is_timing(f)})
  print("\n".join(problems))
  print(f"{len(a)} epochs, {num_fields} non-timing fields: "
        + (f"{len(problems)} differences" if problems else "all equal"))
  return 1 if problems else 0


if __name__ == "__main__":
  sys.exit(main())
