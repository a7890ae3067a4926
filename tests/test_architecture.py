"""The import structure holds: no import cycle among dspark's files, no private name used outside its module,
and the vLLM engine's module is imported only for `--engine vllm`.

The walker reads the source with ast: function-level imports count as much as module-level ones (a cycle
hidden in a function is still two modules that cannot be read apart). `python tests/test_architecture.py`
prints what it finds.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dspark.core.errors import InputError
from dspark.extract.base import engine_class

ROOT = Path(__file__).resolve().parents[1]


def sources(*folders: str) -> list[Path]:
    return sorted(p for f in folders for p in (ROOT / f).rglob("*.py"))


def module_file(name: str) -> Path | None:
    """dspark.a.b -> dspark/a/b.py, or dspark/a/b/__init__.py for a package; None when there is no such file."""
    base = ROOT.joinpath(*name.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


def dspark_imports(path: Path):
    """(line, imported file, names taken from it or None for `import x`) of every dspark import in `path`.

    `from dspark.a import b` names the file dspark/a/b.py when b is a submodule, else dspark/a/__init__.py.
    The parent packages an import runs first are not edges: only the file it names.
    """
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "dspark" and (target := module_file(alias.name)):
                    yield node.lineno, target, None
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "dspark":
            package = module_file(node.module)
            for alias in node.names:
                sub = module_file(f"{node.module}.{alias.name}")
                if sub is not None:
                    yield node.lineno, sub, None
                elif package is not None:
                    yield node.lineno, package, [alias.name]


def import_graph(files: list[Path]) -> dict[Path, set[Path]]:
    graph = {f: set() for f in files}
    for f in files:
        graph[f].update(t for _, t, _ in dspark_imports(f) if t != f)
    return graph


def cycles(graph: dict[Path, set[Path]]) -> list[list[Path]]:
    """One cycle through each strongly connected component of more than one file (Tarjan)."""
    index: dict[Path, int] = {}
    low: dict[Path, int] = {}
    stack: list[Path] = []
    on_stack: set[Path] = set()
    found: list[list[Path]] = []

    def visit(v: Path) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(cycle_in(graph, set(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def cycle_in(graph: dict[Path, set[Path]], component: set[Path]) -> list[Path]:
    """A path from the component's first file back to itself, staying inside the component (breadth first)."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    return [start]


def private_uses(path: Path) -> list[str]:
    """`file:line: name` for each private name of another dspark module that `path` imports or reads.

    Covers `from dspark.x import _name` and `mod._name` where `mod` is bound by a dspark import
    (`import dspark.x as mod`, `from dspark import x`); `import dspark.x` then `dspark.x._name` too.
    """
    tree = ast.parse(path.read_text(), str(path))
    rel = path.relative_to(ROOT)
    found: list[str] = []
    modules: dict[str, Path] = {}  # local name -> the dspark module file it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "dspark":
            for alias in node.names:
                sub = module_file(f"{node.module}.{alias.name}")
                if sub is not None:
                    modules[alias.asname or alias.name] = sub
                elif alias.name.startswith("_") and not alias.name.startswith("__") and \
                        module_file(node.module) != path:
                    found.append(f"{rel}:{node.lineno}: {alias.name} from {node.module}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "dspark" and (target := module_file(alias.name)):
                    modules[alias.asname or alias.name] = target
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = ast.unparse(node.value)
            if owner in modules and modules[owner] != path:
                found.append(f"{rel}:{node.lineno}: {owner}.{node.attr}")
    return found


def test_no_import_cycle_among_dspark_files():
    found = cycles(import_graph(sources("dspark")))
    assert not found, "import cycles:\n" + "\n".join(
        " -> ".join(str(p.relative_to(ROOT)) for p in c) for c in found)


def unit(path: Path) -> str:
    """The top-level folder or root module of dspark a file belongs to (`dspark/train/loop.py` -> `train`)."""
    parts = path.relative_to(ROOT / "dspark").parts
    return parts[0].removesuffix(".py")


def import_rules(root: Path) -> dict[str, set[str] | None]:
    """Each top-level package's rule, the paragraph of its __init__.py docstring that starts `Imports:`: the folders
    and root modules of dspark its files may import besides their own (None for `any`, an empty set for `nothing`;
    a package that states none is missing). Words in parentheses say why and are not names."""
    rules: dict[str, set[str] | None] = {}
    for init in sorted(root.glob("dspark/*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        stated = next((" ".join(p.split()) for p in doc.split("\n\n") if p.startswith("Imports:")), None)
        if stated is None:
            continue
        names = {n.strip() for n in re.sub(r"\([^)]*\)", "", stated.removeprefix("Imports:")).rstrip(". ").split(",")}
        rules[init.parent.name] = None if names == {"any"} else set() if names == {"nothing"} else names
    return rules


def imported_units(files: list[Path]) -> dict[str, set[str]]:
    """Folder or root module -> the other folders and root modules of dspark its files import (dspark/__init__.py,
    the version, is no unit)."""
    out: dict[str, set[str]] = {}
    for f in files:
        for _, target, _ in dspark_imports(f):
            if target != ROOT / "dspark" / "__init__.py" and unit(target) != unit(f):
                out.setdefault(unit(f), set()).add(unit(target))
    return out


def test_each_package_imports_exactly_what_its_init_states():
    rules = import_rules(ROOT)
    used = imported_units(sources("dspark"))
    missing = sorted(p.parent.name for p in ROOT.glob("dspark/*/__init__.py") if p.parent.name not in rules)
    assert not missing, f"packages without an `Imports:` line in their __init__.py docstring: {missing}"
    wrong = []
    for package, allowed in rules.items():
        if allowed is None:
            continue
        have = used.get(package, set())
        wrong += [f"{package} imports {u}, which its __init__.py does not state" for u in sorted(have - allowed)]
        wrong += [f"{package}/__init__.py states {u}, which it does not import" for u in sorted(allowed - have)]
    assert not wrong, "\n".join(wrong)


def test_the_import_rule_check_reads_the_stated_line_and_sees_an_unstated_import(tmp_path, monkeypatch):
    for name, doc, code in (("low", "Imports: nothing.", ""), ("mid", "Bits.\n\nImports: low (its\nparts, all).",
                                                                "from dspark.low import a\n"),
                            ("top", "Imports: low.", "from dspark.mid import b\n")):
        pkg = tmp_path / "dspark" / name
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text(f'"""{doc}"""\n')
        (pkg / "a.py").write_text(code + "a = b = 1\n")
    (tmp_path / "dspark" / "__init__.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert import_rules(tmp_path) == {"low": set(), "mid": {"low"}, "top": {"low"}}
    assert imported_units(sources("dspark")) == {"mid": {"low"}, "top": {"mid"}}
    with pytest.raises(AssertionError, match="top imports mid, which its __init__.py does not state"):
        test_each_package_imports_exactly_what_its_init_states()


def test_no_private_name_is_used_outside_its_module():
    found = [u for f in sources("dspark", "scripts", "tests") for u in private_uses(f)]
    assert not found, "private names used outside their module (make them public where they are defined):\n" + \
        "\n".join(found)


def test_choosing_the_transformers_engine_imports_neither_the_vllm_engine_nor_vllm():
    code = ("import sys; from dspark.extract.base import engine_class; engine_class('transformers'); "
            "print([m for m in ('dspark.extract.vllm_engine', 'vllm') if m in sys.modules])")
    # a child: what a fresh interpreter imports is the claim
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_an_engine_name_no_engine_has_is_refused_in_one_line():
    with pytest.raises(InputError, match=r"unknown --engine value\(s\) \['tensorrt'\]"):
        engine_class("tensorrt")


def test_the_walker_sees_function_level_imports_and_private_names(tmp_path, monkeypatch):
    pkg = tmp_path / "dspark"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from dspark.b import f\n_hidden = 1\n")
    (pkg / "b.py").write_text("def f():\n    from dspark import a\n    return a._hidden\n")
    (pkg / "c.py").write_text("from dspark.a import _hidden\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    files = sources("dspark")
    assert [[p.name for p in c] for c in cycles(import_graph(files))] == [["a.py", "b.py", "a.py"]]
    assert private_uses(pkg / "b.py") == ["dspark/b.py:3: a._hidden"]
    assert private_uses(pkg / "c.py") == ["dspark/c.py:1: _hidden from dspark.a"]


def backend_leaks(path: Path, backends: set[str]) -> list[str]:
    """`file:line: what` for each place `path` builds a ZarrStore, imports the Zarr backend's modules, or compares
    a value with a registered backend's name (`== "zarr"`, `"zarr" in ...`, `in ("live", "mooncake")`)."""
    tree = ast.parse(path.read_text(), str(path))
    rel = path.relative_to(ROOT)

    def names(node) -> set[str]:
        if isinstance(node, ast.Constant) and node.value in backends:
            return {node.value}
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return {e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in backends}
        return set()

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and (getattr(node.func, "id", None) == "ZarrStore"
                                           or getattr(node.func, "attr", None) == "ZarrStore"):
            found.append(f"{rel}:{node.lineno}: ZarrStore(...)")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dspark.connector.zarr"):
            found.append(f"{rel}:{node.lineno}: imports {node.module}")
        elif isinstance(node, ast.Compare):
            hit = set().union(*(names(x) for x in (node.left, *node.comparators)))
            if hit:
                found.append(f"{rel}:{node.lineno}: compares with {sorted(hit)}: {ast.unparse(node)}")
    return found


def test_nothing_outside_the_connector_builds_a_zarr_store_or_compares_a_backend_name():
    """The storage seam: stores open through the registry (`open_store`), and callers ask a backend's descriptor
    (`live`, `offline`, `at_rest`) instead of testing its name."""
    from dspark.connector.registry import BACKENDS

    connector = ROOT / "dspark" / "connector"
    found = [leak for f in sources("dspark") if connector not in f.parents
             for leak in backend_leaks(f, set(BACKENDS.names()))]
    assert not found, "the storage seam leaks (ask the connector instead):\n" + "\n".join(found)


def test_the_leak_walker_sees_calls_imports_and_every_kind_of_comparison(tmp_path, monkeypatch):
    (tmp_path / "m.py").write_text(
        "from dspark.connector.zarr.reader import ZarrStore\n"
        "s = ZarrStore('x')\n"
        "a = cfg.source != 'zarr'\n"
        "b = 'zarr' in to.split(',')\n"
        "c = k in ('live', 'mooncake')\n"
        "d = cfg.source == 'other'\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert [line.split(":")[1] for line in backend_leaks(tmp_path / "m.py", {"zarr", "mooncake"})] == \
        ["1", "2", "3", "4", "5"]


if __name__ == "__main__":
    for c in cycles(import_graph(sources("dspark"))):
        print("cycle:", " -> ".join(str(p.relative_to(ROOT)) for p in c))
    for f in sources("dspark", "scripts", "tests"):
        for u in private_uses(f):
            print("private:", u)
