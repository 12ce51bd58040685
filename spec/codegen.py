"""Generate ``refimpl`` from the spec: the Python lowering.

The spec modules are read as syntax trees; every call of a term-language operator is replaced by the
Python source its :data:`kvhit.spec.terms.OPERATORS` entry gives (``ite(c, a, b)`` becomes
``(a if c else b)``, ``min_`` becomes ``min``, ...), imports between spec modules are dropped, and the
modules are written one after another into a single module with the same function names and docstrings.
Nothing of the generator, of the term language or of Z3 is needed to run the result.

    python -m kvhit.spec.codegen            # write refimpl/
    python -m kvhit.spec.codegen --check    # exit 1 if refimpl/ differs from what the spec generates
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import sys
from pathlib import Path

from .terms import OPERATORS

SPEC_DIR = Path(__file__).resolve().parent
# In dependency order. terms/lower_z3/codegen are the lowering machinery, not part of the policy.
SOURCES = ("runtime", "domain", "sizes", "cache", "policy", "retention", "api")
STDLIB_IMPORTS = ("import itertools", "import math", "from dataclasses import dataclass, field, replace",
                  "from enum import Enum")


class _LowerOperators(ast.NodeTransformer):
    def visit_Call(self, node: ast.Call):
        self.generic_visit(node)
        if isinstance(node.func, ast.Name) and node.func.id in OPERATORS:
            op = OPERATORS[node.func.id]
            if node.keywords:
                raise ValueError(f"operator {op.name} called with keywords")
            args = [ast.unparse(a) for a in node.args]
            return ast.parse(op.source.format(*args), mode="eval").body
        return node


def _lowered_away(name: str) -> bool:
    """Whether every call of ``name`` becomes other code in the generated module (an operator whose
    source does not call it by its own name), so that its definition would be dead there."""
    return name in OPERATORS and not OPERATORS[name].source.startswith(f"{name}(")


def _lower_module(name: str) -> tuple[str, str]:
    source = (SPEC_DIR / f"{name}.py").read_text()
    tree = ast.parse(source)
    body = []
    doc = ast.get_docstring(tree) or ""
    for stmt in tree.body:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and stmt is tree.body[0]:
            continue  # the module docstring becomes a section comment
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            continue  # spec-internal imports disappear; stdlib ones are collected in the header
        if isinstance(stmt, ast.FunctionDef) and _lowered_away(stmt.name):
            continue  # an operator's spec-side meaning (cache.written): no generated call reaches it
        body.append(_LowerOperators().visit(stmt))
    module = ast.Module(body=body, type_ignores=[])
    ast.fix_missing_locations(module)
    return doc, ast.unparse(module)


def spec_digest() -> str:
    h = hashlib.sha256()
    for name in ("terms",) + SOURCES:
        h.update((SPEC_DIR / f"{name}.py").read_bytes())
    h.update(Path(__file__).read_bytes())
    return h.hexdigest()


def generate() -> dict[str, str]:
    """The files of ``refimpl/``, by name."""
    sections = []
    for name in SOURCES:
        doc, code = _lower_module(name)
        rule = "# " + "-" * 98
        comment = "\n".join(f"# {line}".rstrip() for line in doc.splitlines())
        sections.append(f"{rule}\n# spec/{name}.py\n{comment}\n{rule}\n\n{code}\n")
    body = "\n".join(STDLIB_IMPORTS) + "\n\n\n" + "\n\n".join(sections)
    out_digest = hashlib.sha256(body.encode()).hexdigest()
    header = (
        f'"""kvhit reference implementation, GENERATED from spec/ by `make gen` '
        f"(python -m kvhit.spec.codegen). DO NOT EDIT.\n\n"
        f"Sources: {', '.join(f'spec/{n}.py' for n in SOURCES)} (lowered with spec/terms.py's operator table).\n"
        f"spec-sha256: {spec_digest()}\n"
        f"output-sha256: {out_digest}\n"
        f'"""\n\n'
    )
    init = (
        '"""kvhit\'s generated reference implementation (see policy.py). DO NOT EDIT: `make gen`."""\n\n'
        "from .policy import *  # noqa: F401,F403\n"
        "from .policy import (ALL_POLICIES, CacheState, Group, Junction, Kind, Layout, Mode, Replay, Rules, Sizes,\n"
        "                     SpecGroup, Speculation, as_cache, derive_sizes, hit, hit_tokens, policy_rules,\n"
        "                     sizes_for)\n"
    )
    return {"policy.py": header + body, "__init__.py": init}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if refimpl/ is stale or hand-edited")
    parser.add_argument("--out", type=Path, default=SPEC_DIR.parent / "refimpl")
    args = parser.parse_args(argv)
    files = generate()
    if args.check:
        stale = [n for n, text in files.items()
                 if not (args.out / n).exists() or (args.out / n).read_text() != text]
        if stale:
            print(f"refimpl/ is stale or hand-edited: {', '.join(stale)} differ from the spec; run `make gen`",
                  file=sys.stderr)
            return 1
        print("refimpl/ is fresh")
        return 0
    args.out.mkdir(exist_ok=True)
    for name, text in files.items():
        (args.out / name).write_text(text)
    print(f"wrote {', '.join(sorted(files))} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
