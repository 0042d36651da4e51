"""Checking a workload spec without running anything it names.

A spec is checked where it must not run: in `policy check`, in the daemon's process when it loads the
policy folders, and in `bench` before any worker starts. So nothing here imports the user's module or
an adapter library. A `module:factory` module is located the way the worker's import system will
(the finders on `sys.meta_path`, over the current directory and `sys.path`; a dotted module through
its parents' search locations, without executing their `__init__`), its source is parsed with `ast`,
and the factory must be bound at its top level. An adapter spec needs its library installed; whether
the library knows the model name is checked by the worker, which imports it.

What static analysis cannot settle (a star import, a module `__getattr__`, a compiled extension) is
let through: the worker reports it, in its own process, as a failed run.
"""

from __future__ import annotations

import ast
import difflib
import importlib.machinery
import importlib.util
import os
import sys
from importlib.machinery import ModuleSpec
from pathlib import Path

from joulepilot.store.safeio import FileRefused, read_regular_file, shorten

from .workloads import LibraryMissing, WorkloadError, quote_spec, split_spec

MAX_SOURCE_BYTES = 32 << 20
# A literal bound at top level is never a factory.
_LITERALS = (ast.Constant, ast.List, ast.Tuple, ast.Dict, ast.Set, ast.JoinedStr, ast.ListComp, ast.SetComp,
             ast.DictComp, ast.GeneratorExp)
# Calls that can bind module attributes at run time in ways a parse cannot follow.
_DYNAMIC_NAMES = {"globals", "vars", "setattr", "exec"}
_IMPORTED = ast.Pass()  # stands for a name bound by `import x`: a module, never a factory to suggest


def check_spec_statically(spec: str) -> None:
    """WorkloadError for a spec that cannot be built; executes none of the code the spec names."""
    kind, name = split_spec(spec)
    if kind == "builtin":
        return
    importlib.invalidate_caches()  # a module written a moment ago (or since the last pass) is seen
    if kind == "factory":
        _check_factory(spec)
        return
    if _find_module(kind) is None:
        raise LibraryMissing(f"workload {quote_spec(spec)} needs the {kind!r} package, which is not installed "
                            f"in this Python ({sys.executable})", f"pip install {kind}")


def _search_roots() -> list[str]:
    """Where the worker will look for a top-level module: the current directory, PYTHONPATH, sys.path
    (the runner passes the parent's import roots to the worker on PYTHONPATH)."""
    try:
        cwd = [os.getcwd()]
    except OSError:  # the current directory was removed
        cwd = []
    roots = [*cwd, *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p), *sys.path]
    return list(dict.fromkeys(roots))


def _find_module(name: str, locations: list[str] | None = None) -> ModuleSpec | None:
    """The spec of `name` from the meta-path finders, without importing it (for a submodule, pass its
    parent's `submodule_search_locations`; finders only look, they do not execute)."""
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        path = locations
        if path is None and finder is importlib.machinery.PathFinder:
            path = _search_roots()
        try:
            found = find(name, path)
        except (ImportError, OSError, ValueError, AttributeError, TypeError):
            continue
        if found is not None:
            return found
    return None


def _locate(module_name: str, spec: str) -> ModuleSpec | None:
    """The module's spec; None when a parent is a plain module, which only running it could tell more of."""
    parts = module_name.split(".")
    if not all(part.isidentifier() for part in parts):
        raise WorkloadError(f"workload {quote_spec(spec)}: {shorten(module_name, 100)!r} is not a module name",
                            "write package.module:factory or path/to/file.py:factory")
    found: ModuleSpec | None = None
    for depth in range(1, len(parts) + 1):
        name = ".".join(parts[:depth])
        locations = None
        if found is not None:
            locations = found.submodule_search_locations
            if locations is None:  # a plain module that puts submodules in sys.modules itself (os.path)
                return None
            locations = list(locations)
        found = _find_module(name, locations)
        if found is None:
            missing = "" if name == module_name else f" (no {name!r})"
            raise WorkloadError(f"workload {quote_spec(spec)}: module {module_name!r} is not importable{missing}",
                                "check the name and that its folder is the current directory or on PYTHONPATH")
    return found


def _source(found: ModuleSpec, spec: str) -> tuple[str | None, str]:
    """The module's source text (None when there is none to read: built-in, frozen, compiled) and where
    it is. Only a regular file is read."""
    origin = found.origin or found.name
    if found.submodule_search_locations is not None and found.origin in (None, "namespace"):
        return "", "a folder without __init__.py"
    if found.origin and found.has_location and found.origin.endswith(".py"):
        return _read_source(Path(found.origin), spec), origin
    get_source = getattr(found.loader, "get_source", None)
    if get_source is None:
        return None, origin
    try:
        return get_source(found.name), origin
    except (ImportError, OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None, origin


def _read_source(path: Path, spec: str) -> str:
    try:
        data = read_regular_file(path, max_bytes=MAX_SOURCE_BYTES)
    except FileRefused as exc:
        raise WorkloadError(f"workload {quote_spec(spec)}: {exc.path}: {exc.reason}") from None
    except OSError as exc:
        raise WorkloadError(f"workload {quote_spec(spec)}: {path} cannot be read ({exc.strerror or exc})") from None
    try:
        return importlib.util.decode_source(data)
    except (SyntaxError, UnicodeDecodeError, LookupError) as exc:
        raise WorkloadError(f"workload {quote_spec(spec)}: {path} is not readable Python source ({exc})",
                            "save it as UTF-8") from None


def _check_factory(spec: str) -> None:
    module_name, _, attr = spec.rpartition(":")
    head = attr.split(".")[0]
    if not all(part.isidentifier() for part in attr.split(".")):
        raise WorkloadError(f"workload {quote_spec(spec)}: {shorten(attr, 100)!r} is not a Python name")
    if module_name.endswith(".py"):
        path = Path(module_name).expanduser()
        if not path.exists():
            raise WorkloadError(f"workload {quote_spec(spec)}: file {path} does not exist",
                                f"the path is relative to the current directory ({os.getcwd()})")
        source, where = _read_source(path, spec), str(path)
        what = f"file {path}"
    else:
        found = _locate(module_name, spec)
        if found is None:
            return
        source, where = _source(found, spec)
        what = f"module {module_name!r}"
    if source is None:
        return  # compiled or built in: nothing to read; the worker will tell
    try:
        tree = ast.parse(source, filename=where)
    except SyntaxError as exc:
        raise WorkloadError(f"workload {quote_spec(spec)}: {what} has a syntax error at line {exc.lineno}: "
                            f"{exc.msg} (in {where})") from None
    except (ValueError, RecursionError, MemoryError) as exc:
        raise WorkloadError(f"workload {quote_spec(spec)}: {what} cannot be parsed "
                            f"({type(exc).__name__}; in {where})") from None
    bindings, uncertain = _top_level_bindings(tree)
    if head in bindings:
        if all(node is not None and _is_literal(node) for node in bindings[head]):
            raise WorkloadError(f"workload {quote_spec(spec)}: {head!r} in {what} is not callable (in {where})",
                                "name the function or class that builds the model")
        return
    if uncertain or head in _walrus_names(tree):
        return
    public = sorted(n for n, nodes in bindings.items() if not n.startswith("_") and _maybe_callable(nodes))
    guess = difflib.get_close_matches(head, public, n=1, cutoff=0.5)
    hint = f"did you mean {guess[0]!r}?" if guess else f"callables there: {', '.join(public[:12]) or 'none'}"
    raise WorkloadError(f"workload {quote_spec(spec)}: {what} has no attribute {shorten(head, 100)!r} "
                        f"(in {where})", hint)


def _is_literal(node: ast.AST) -> bool:
    value = getattr(node, "value", None)
    return isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(value, _LITERALS)


def _maybe_callable(nodes: list[ast.AST | None]) -> bool:
    return not all(node is _IMPORTED or node is not None and _is_literal(node) for node in nodes)


def _top_level_bindings(tree: ast.Module) -> tuple[dict[str, list[ast.AST | None]], bool]:
    """Names bound at the module's top level (each with the statements binding it, None where the value
    cannot be told), and whether the module may bind names a parse cannot see."""
    bindings: dict[str, list[ast.AST | None]] = {}
    uncertain = False

    def bind(target: ast.AST, node: ast.AST | None) -> None:
        if isinstance(target, ast.Name):
            bindings.setdefault(target.id, []).append(node)
        elif isinstance(target, ast.Tuple | ast.List):
            for element in target.elts:
                bind(element, None)
        elif isinstance(target, ast.Starred):
            bind(target.value, None)

    def visit(statements: list[ast.stmt]) -> None:
        nonlocal uncertain
        for st in statements:
            if isinstance(st, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                bindings.setdefault(st.name, []).append(st)
                uncertain |= st.name == "__getattr__"
            elif isinstance(st, ast.Assign):
                for target in st.targets:
                    bind(target, st)
            elif isinstance(st, ast.AnnAssign):
                if st.value is not None:  # `x: int` alone binds nothing at run time
                    bind(st.target, st)
            elif isinstance(st, ast.AugAssign):
                bind(st.target, None)
            elif isinstance(st, ast.Import):
                for alias in st.names:
                    bindings.setdefault(alias.asname or alias.name.split(".")[0], []).append(_IMPORTED)
            elif isinstance(st, ast.ImportFrom):
                for alias in st.names:
                    if st.module == "__future__":
                        continue
                    if alias.name == "*":
                        uncertain = True
                    else:
                        bindings.setdefault(alias.asname or alias.name, []).append(None)
            elif isinstance(st, ast.For | ast.AsyncFor):
                bind(st.target, None)
                visit(st.body)
                visit(st.orelse)
            elif isinstance(st, ast.With | ast.AsyncWith):
                for item in st.items:
                    if item.optional_vars is not None:
                        bind(item.optional_vars, None)
                visit(st.body)
            elif isinstance(st, ast.If | ast.While):
                visit(st.body)
                visit(st.orelse)
            elif isinstance(st, ast.Try | ast.TryStar):
                visit(st.body)
                for handler in st.handlers:
                    if handler.name:
                        bindings.setdefault(handler.name, []).append(None)
                    visit(handler.body)
                visit(st.orelse)
                visit(st.finalbody)
            elif isinstance(st, ast.Match):
                for case in st.cases:
                    for node in ast.walk(case.pattern):
                        name = getattr(node, "name", None)
                        if isinstance(name, str):
                            bindings.setdefault(name, []).append(None)
                    visit(case.body)

    visit(tree.body)
    if not uncertain:
        uncertain = any(isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _DYNAMIC_NAMES
                        or isinstance(node, ast.Attribute) and node.attr == "__dict__"
                        for node in ast.walk(tree))
    return bindings, uncertain


def _walrus_names(tree: ast.Module) -> set[str]:
    return {node.target.id for node in ast.walk(tree)
            if isinstance(node, ast.NamedExpr) and isinstance(node.target, ast.Name)}

