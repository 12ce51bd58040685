"""Generate ``refimpl`` from the spec: the Python lowering.

The spec modules are read as syntax trees; every call of a term-language operator is replaced by the
Python source its :data:`kvhit.spec.terms.OPERATORS` entry gives (``ite(c, a, b)`` becomes
``(a if c else b)``, ``min_`` becomes ``min``, ...), imports between spec modules are dropped, and the
modules are written one after another into a single module with the same function names and docstrings.
Nothing of the generator, of the term language or of Z3 is needed to run the result.

It also writes ``refimpl/staging.py``, the staged lowering (:mod:`kvhit.spec.stage`) as a module of the
refimpl, so that the vLLM adapter's serving process imports nothing of ours but ``kvhit.refimpl``
(:func:`generate_staging`).

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


# The staged lowering and the operators it executes the spec with (:func:`generate_staging`).
STAGING_MODULES = ("terms", "stage")


def _top_level_names(stmt: ast.stmt) -> list[str]:
    if isinstance(stmt, (ast.FunctionDef, ast.ClassDef)):
        return [stmt.name]
    if isinstance(stmt, ast.Assign):
        return [t.id for t in stmt.targets if isinstance(t, ast.Name)]
    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
        return [stmt.target.id]
    return []


def _spec_module(name: str):
    """``(docstring, statements, own definitions by name, imported names -> (module, name), stdlib imports)``
    of ``spec/<name>.py``."""
    tree = ast.parse((SPEC_DIR / f"{name}.py").read_text())
    body = tree.body[1:] if ast.get_docstring(tree) is not None else tree.body
    own, imported, stdlib, stmts = {}, {}, [], []
    for stmt in body:
        if isinstance(stmt, ast.ImportFrom) and stmt.level == 1:
            for alias in stmt.names:
                if alias.asname:
                    raise ValueError(f"spec/{name}.py imports {alias.name} as {alias.asname}: the generated "
                                     "modules share one namespace, so spec modules import names as they are")
                # `from . import runtime` names a module; `from .x import y` a definition of x
                imported[alias.name] = (alias.name, None) if stmt.module is None else (stmt.module, alias.name)
        elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
            _check_stdlib(stmt, name)
            if not (isinstance(stmt, ast.ImportFrom) and stmt.module == "__future__"):
                stdlib.append(ast.unparse(stmt))
        else:
            stmts.append(stmt)
            for n in _top_level_names(stmt):
                own[n] = stmt
    return ast.get_docstring(tree) or "", stmts, own, imported, stdlib


# What the staged module may import besides the refimpl: the standard library modules the spec uses, and z3
# (terms imports it inside the function that builds a Z3 term, which staging never calls).
STAGING_IMPORTS = ("__future__", "contextlib", "contextvars", "dataclasses", "enum", "itertools", "math", "typing",
                   "z3")


def _check_stdlib(node: ast.stmt, module: str) -> None:
    names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
    for name in names:
        if name.split(".")[0] not in STAGING_IMPORTS:
            raise ValueError(f"spec/{module}.py imports {name}: the staged module may import only "
                             f"{', '.join(STAGING_IMPORTS)} and the refimpl (the serving process imports "
                             "nothing else of kvhit)")


def _names_used(stmt: ast.stmt) -> set[str]:
    return {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def generate_staging() -> str:
    """``refimpl/staging.py``: :mod:`kvhit.spec.stage` and what it runs, for the adapter's serving process.

    The staged lowering executes the spec's functions on staged values, so it needs them as the spec
    writes them (each operator a call of :mod:`kvhit.spec.terms`, which dispatches to the lowering in
    force), not as ``refimpl/policy.py`` has them (each operator replaced by its Python source, which
    cannot take a staged value). The module is, in this order: ``terms`` and ``stage`` whole (their
    imports of spec modules dropped), then every function of the policy modules that they reach (through
    :func:`kvhit.spec.stage.stage_hit_tokens`) and that names an operator or calls such a function, copied
    as the spec writes it; a class or constant that names one is refused (it would come lowered). The other functions it reaches (``derive_sizes``, ``policy_rules``, ...)
    are the same code in ``refimpl/policy.py``, and the policy modules' classes and constants (``Sizes``,
    ``Rules``, ``REFERENCE``, ...) are its too: they are imported from ``.policy``, so the staged functions
    run on the refimpl's own domain values (the engine passes them no others). ``runtime`` is ``.policy`` too (codegen copies it there as it is). Every name keeps the
    spec's (spec modules import names unrenamed, and the generator refuses two definitions of one name).
    """
    modules = {name: _spec_module(name) for name in STAGING_MODULES + SOURCES}
    emitted: dict[str, tuple[str, ast.stmt]] = {}  # name -> (module, definition)
    stdlib: list[str] = []
    sections = []

    def define(name: str, module: str, stmt: ast.stmt) -> None:
        if name in emitted and emitted[name] != (module, stmt):
            raise ValueError(f"{name} is defined by spec/{emitted[name][0]}.py and spec/{module}.py: the staged "
                             "module would have one of them")
        emitted[name] = (module, stmt)

    for name in STAGING_MODULES:
        doc, stmts, own, _, imports = modules[name]
        stdlib += imports
        for n, stmt in own.items():
            define(n, name, stmt)
        sections.append((name, doc, stmts))
    # Every definition terms and stage reach, each with the definitions it names (``refs``; a method's or a
    # default value's names are its class's or constant's).
    refs: dict[tuple[str, str], set[tuple[str, str]]] = {}
    wanted = [(name, n) for name in STAGING_MODULES for n in modules[name][2]]
    while wanted:
        key = wanted.pop()
        if key in refs:
            continue
        module, name = key
        _, _, own, imported, _ = modules[module]
        refs[key] = set()
        for used in sorted(_names_used(own[name])):
            target = (module, used) if used in own else imported.get(used)
            if target is None:
                continue  # a builtin, a local or a parameter
            if target[1] is None:  # a module: runtime, copied into .policy as it is
                if target[0] != "runtime":
                    raise ValueError(f"spec/{module}.py imports the module {target[0]}; only runtime is supported")
                continue
            refs[key].add(target)
            wanted.append(target)

    def is_function(key):
        return key[0] in SOURCES and key[0] != "runtime" and isinstance(modules[key[0]][2][key[1]], ast.FunctionDef)

    # A spec function must run as the spec writes it when it names terms or stage (an operator, the lowering
    # in force), or names one that must; any other is the same code in refimpl/policy.py (codegen changes
    # only operator calls) and comes from there, as the classes and constants do.
    copied: set[tuple[str, str]] = set()
    while True:
        more = {key for key, named in refs.items() if is_function(key) and key not in copied
                and any(t[0] in STAGING_MODULES or t in copied for t in named)}
        if not more:
            break
        copied |= more
    for key, named in refs.items():
        if key[0] in SOURCES and not is_function(key) and any(t[0] in STAGING_MODULES or t in copied for t in named):
            raise ValueError(f"spec/{key[0]}.py: {key[1]} (a class or constant) names "
                             f"{sorted(t[1] for t in named if t[0] in STAGING_MODULES or t in copied)}, which the "
                             "staged module must run as the spec writes them; it would import it from .policy, "
                             "with the operators replaced")
    for module, name in copied:
        define(name, module, modules[module][2][name])
    emitted_keys = {(name, n) for name in STAGING_MODULES for n in modules[name][2]} | copied
    from_policy = {t[1] for key in emitted_keys for t in refs[key] if t[0] in SOURCES and t not in copied}
    for module, name in emitted_keys:  # no import hides inside a function either
        for node in ast.walk(modules[module][2][name]):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                _check_stdlib(node, module)
    clash = from_policy & set(emitted)
    if clash:
        raise ValueError(f"{', '.join(sorted(clash))}: both copied and imported from .policy")
    for name in SOURCES:
        stmts = [s for s in modules[name][1] if any((name, n) in copied for n in _top_level_names(s))]
        if stmts:
            stdlib += modules[name][4]
            sections.append((name, f"The functions of spec/{name}.py the staged hit reaches that name an operator "
                                   "(or call one that does), as the spec writes them.", stmts))
    rule = "# " + "-" * 98
    parts = []
    for name, doc, stmts in sections:
        comment = "\n".join(f"# {line}".rstrip() for line in doc.splitlines())
        module = ast.Module(body=list(stmts), type_ignores=[])
        parts.append(f"{rule}\n# spec/{name}.py\n{comment}\n{rule}\n\n{ast.unparse(module)}\n")
    imports = ["from __future__ import annotations", *dict.fromkeys(stdlib),
               "from . import policy as runtime",
               f"from .policy import {', '.join(sorted(from_policy))}"]
    body = "\n".join(imports) + "\n\n\n" + "\n\n".join(parts)
    header = (
        f'"""kvhit\'s staged lowering, GENERATED from spec/ by `make gen` (python -m kvhit.spec.codegen). '
        f"DO NOT EDIT.\n\n"
        f"spec/stage.py's stage_hit_tokens and what it runs: spec/terms.py and spec/stage.py, and the functions of\n"
        f"{', '.join(f'spec/{n}.py' for n in SOURCES if n != 'runtime')} they reach that name an operator\n"
        f"(or one that does), copied as the spec writes them; the rest, and the domain types, from refimpl/policy.py.\n"
        f"See kvhit.spec.codegen.generate_staging.\n"
        f"Z3 is imported only if a Z3 term is built, which nothing here does.\n"
        f"spec-sha256: {spec_digest()}\n"
        f"output-sha256: {hashlib.sha256(body.encode()).hexdigest()}\n"
        f'"""\n\n'
    )
    return header + body


def spec_digest() -> str:
    h = hashlib.sha256()
    for name in ("terms", "stage") + SOURCES:
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
    return {"policy.py": header + body, "__init__.py": init, "staging.py": generate_staging()}


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
