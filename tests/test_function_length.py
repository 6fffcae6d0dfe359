"""No function in cpjax/ is over 60 lines (docstring aside), read from the source with `ast`.

A function whose body is one `return` of a literal dict, list, tuple or set (a table: a config
schema's field checks) is left out: its length is its data's, not its logic's.
"""

import ast
import os
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMIT = 60
_DISPLAYS = (ast.Dict, ast.List, ast.Tuple, ast.Set)


def _docstring_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
  first = node.body[0]
  if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
      and isinstance(first.value.value, str)):
    return first.end_lineno - first.lineno + 1
  return 0


def _is_table(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
  """Whether the body, docstring aside, is one `return` of a literal display."""
  body = node.body[1:] if _docstring_lines(node) else node.body
  return (len(body) == 1 and isinstance(body[0], ast.Return)
          and isinstance(body[0].value, _DISPLAYS))


def long_functions(source: str, limit: int = LIMIT) -> list[tuple[str, int, int]]:
  """(name, line, length) of each function (nested ones and methods too) of `source` over
  `limit` lines: from its `def` line to its last, its docstring's lines not counted, tables
  left out."""
  out = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_table(node):
      length = node.end_lineno - node.lineno + 1 - _docstring_lines(node)
      if length > limit:
        out.append((node.name, node.lineno, length))
  return out


def test_the_count_leaves_out_the_docstring_and_tables_only():
  """Hand-made sources: 61 statement lines is too long, 60 with a 5-line docstring is not, a
  70-entry table is not; a 70-line nested function is found, and its 72-line outer one."""
  def function(name: str, lines: int, docstring: int = 0) -> str:
    doc = ['  """'] + ["  doc"] * (docstring - 2) + ['  """'] if docstring else []
    return "\n".join([f"def {name}():", *doc, *["  x = 1"] * (lines - 1)]) + "\n"
  assert long_functions(function("f", 61)) == [("f", 1, 61)]
  assert long_functions(function("g", 60, docstring=5)) == []
  table = "def t():\n  '''A table.'''\n  return {\n" + "    'k': 1,\n" * 70 + "  }\n"
  assert long_functions(table) == []
  nested = "def outer():\n" + textwrap.indent(function("inner", 70), "  ") + "  return inner\n"
  assert long_functions(nested) == [("outer", 1, 72), ("inner", 2, 70)]


def test_no_function_in_cpjax_is_over_60_lines():
  found = []
  for folder, dirs, files in os.walk(os.path.join(REPO, "cpjax")):
    dirs[:] = [d for d in dirs if d != "__pycache__"]
    for name in sorted(f for f in files if f.endswith(".py")):
      path = os.path.join(folder, name)
      with open(path, encoding="utf-8") as f:
        found += [f"{os.path.relpath(path, REPO)}:{line} {function} ({length} lines)"
                  for function, line, length in long_functions(f.read())]
  assert not found, "functions over 60 lines (docstring aside):\n" + "\n".join(found)
