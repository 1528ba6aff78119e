"""The library's size and shape figures (issue 39): code lines, long functions, imports inside
functions, the public root and import circles between modules.

    python scripts/code_stats.py            # the figures, one a line
    python scripts/code_stats.py --long     # also every function over 50 code lines
    python scripts/code_stats.py --inner    # also every import inside a function

Counted over ``git ls-files 'elastic_trainer/*.py' 'rendezvous/*.py'``. A code line is a line
that is not blank, not inside a docstring (module, class or function) and not a comment alone.
A function's code lines are those of its body by the same rule (nested functions included).
An import circle is a cycle among the modules' imports, those inside functions and under
``TYPE_CHECKING`` included (moving an import there hides a circle, it does not break it), found
as strongly connected components (Tarjan).
"""

from __future__ import annotations

import argparse
import ast
import io
import subprocess
import sys
import tokenize
from pathlib import Path

LONG = 50


def _files(root: Path) -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "elastic_trainer/*.py", "rendezvous/*.py"],
        cwd=root,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    return [root / name for name in out if (root / name).exists()]


def _docstring_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                end = body[0].end_lineno or body[0].lineno
                lines.update(range(body[0].lineno, end + 1))
    return lines


def _code_lines(source: str, tree: ast.AST) -> set[int]:
    """The numbers of the lines that hold code (a token other than a comment or a docstring)."""
    docs = _docstring_lines(tree)
    lines: set[int] = set()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
    skip.add(tokenize.ENDMARKER)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in skip:
            continue
        for line in range(tok.start[0], tok.end[0] + 1):
            if line not in docs:
                lines.add(line)
    return lines


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(tree: ast.Module, module: str, is_package: bool) -> set[str]:
    """Modules imported anywhere in a module: in functions and under TYPE_CHECKING too."""
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    package = module.split(".") if is_package else module.split(".")[:-1]
                    package = package[: len(package) - (node.level - 1)]
                    base = ".".join([*package, base] if base else package)
                names.add(base)
                names.update(f"{base}.{alias.name}" for alias in node.names)
            else:
                for field in ("body", "orelse", "finalbody", "handlers"):
                    visit([n for n in getattr(node, field, []) if isinstance(n, ast.AST)])

    visit(tree.body)
    return names


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10_000)

    def strong(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                strong(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            strong(node)
    return found


def _root_exports(root: Path) -> list[str]:
    tree = ast.parse((root / "elastic_trainer/__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.AnnAssign | ast.Assign):
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            if any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in targets):
                value = node.value
                if isinstance(value, ast.Dict):
                    return [k.value for k in value.keys if isinstance(k, ast.Constant)]
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--long", action="store_true", help="list the functions over 50 lines")
    parser.add_argument("--inner", action="store_true", help="list imports inside functions")
    args = parser.parse_args(argv)
    root = Path(__file__).resolve().parent.parent
    total = 0
    functions: list[tuple[int, str]] = []
    inner: list[str] = []
    graph: dict[str, set[str]] = {}
    for path in _files(root):
        source = path.read_text()
        tree = ast.parse(source)
        code = _code_lines(source, tree)
        total += len(code)
        rel = path.relative_to(root)
        module = _module_name(root, path)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                first = node.lineno
                last = node.end_lineno or first
                count = sum(1 for line in range(first, last + 1) if line in code)
                functions.append((count, f"{rel}:{node.lineno} {node.name}"))
                for sub in ast.walk(node):
                    if isinstance(sub, ast.Import | ast.ImportFrom):
                        inner.append(f"{rel}:{sub.lineno}")
        graph[module] = _imports(tree, module, path.name == "__init__.py")
    modules = set(graph)
    graph = {m: {n for n in deps if n in modules and n != m} for m, deps in graph.items()}
    long = sorted((f for f in functions if f[0] > LONG), reverse=True)
    cycles = _cycles(graph)
    exports = _root_exports(root)
    share = 100 * len(long) / max(len(functions), 1)
    print(f"code lines: {total}")
    print(f"functions: {len(functions)}; over {LONG} code lines: {len(long)} ({share:.1f} %)")
    print(f"imports inside functions: {len(inner)}")
    print(f"names at the package root: {len(exports)}")
    print(f"import circles: {len(cycles)}")
    for cycle in cycles:
        print("  circle: " + " <-> ".join(cycle))
    if args.long:
        for count, where in long:
            print(f"  {count:4d} {where}")
    if args.inner:
        for where in inner:
            print(f"  {where}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
