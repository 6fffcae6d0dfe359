"""Writes the docs' option tables of the registries (policies, scores, losses, conformal scores).

  python -m scripts.registry_tables          # rewrite the tables in docs/*.md
  python -m scripts.registry_tables --check  # exit 1 if a table differs from the registry

Each table sits in its page between `<!-- registry:NAME -->` and `<!-- /registry -->`;
tests/test_registry.py checks that the pages hold exactly what `render` writes, so a new
entry or setting shows in the docs once this script has run.
"""

import argparse
import os
import re
import sys

from cpjax import registry
from cpjax.calibration import conformal, losses
from cpjax.selection import policies, scores

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = {"selection.method": "docs/selection.md", "selection.score": "docs/selection.md",
         "loss.name": "docs/losses.md", "evaluation.conformal_scores": "docs/evaluation.md"}


def _yes(flag: bool) -> str:
  return "yes" if flag else ""


def tables() -> dict[str, str]:
  """{table name: Markdown table} of every registry."""
  return {
      "selection.method": registry.markdown_table(policies.POLICIES, {
          "reads scores": lambda p: _yes(p.needs_scores),
          "weights the loss": lambda p: _yes(p.returns_weights)}),
      "selection.score": registry.markdown_table(scores.SCORES, {
          "uses labels": lambda s: _yes(s.uses_labels)}),
      "loss.name": registry.markdown_table(losses.LOSSES, {
          "probability targets (mixup)": lambda spec: _yes(spec.soft_targets),
          "meta-objective settings": lambda spec: ", ".join(
              f"`{s.name}`" for s in spec.meta_settings)}),
      "evaluation.conformal_scores": registry.markdown_table(conformal.SCORES, {
          "randomisable": lambda s: _yes(s.randomised)}),
  }


def render(text: str, generated: dict[str, str]) -> str:
  """`text` with each registry table between its markers replaced by `generated`'s."""
  def table(match: re.Match) -> str:
    name = match.group(1)
    if name not in generated:
      raise ValueError(f"unknown registry table {name!r}; valid: {', '.join(generated)}")
    return f"<!-- registry:{name} -->\n{generated[name]}\n<!-- /registry -->"
  return re.sub(r"<!-- registry:(\S+) -->\n.*?<!-- /registry -->", table, text, flags=re.S)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--check", action="store_true", help="compare only; write nothing")
  args = parser.parse_args()
  generated, stale = tables(), []
  for page in sorted(set(PAGES.values())):
    path = os.path.join(REPO, page)
    with open(path) as f:
      text = f.read()
    new = render(text, generated)
    if new != text:
      stale.append(page)
      if not args.check:
        with open(path, "w") as f:
          f.write(new)
  print(("stale: " if args.check else "rewrote: ") + ", ".join(stale) if stale else "up to date")
  return 1 if args.check and stale else 0


if __name__ == "__main__":
  sys.exit(main())
