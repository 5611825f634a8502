"""The import rules of the repository, read from the source with `ast` (no module is imported).

    scripts -> (sprout.train, data_loader) -> core (sprout minus sprout.train)

- `sprout.prep` and `sprout.formats` never import torch (nor accelerate or safetensors.torch),
  directly or through any sprout module they import, at any depth, counting imports inside
  functions and the package `__init__`s that importing a module runs;
- `data_loader` never imports `sprout.train`;
- core never imports `sprout.train` or `data_loader`;
- nothing in `sprout` or `data_loader` imports `scripts`, `benchmarks` or `tests`;
- no import cycles between modules at module level (imports inside functions may close a
  loop: they run after both modules are loaded).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCH = ("torch", "accelerate", "safetensors.torch")


def read_tree(root: Path = ROOT) -> dict[str, str]:
    """Module name -> source for sprout, data_loader and scripts."""
    sources = {}
    for base, pattern in ((root / "src", "sprout/**/*.py"), (root, "data_loader/**/*.py"), (root, "scripts/*.py")):
        for path in sorted(base.glob(pattern)):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            sources[".".join(parts)] = path.read_text(encoding="utf-8")
    return sources


def imports_of(name: str, source: str, is_package: bool) -> list[tuple[str, bool]]:
    """(imported dotted name, at module level?) for every import statement in `source`."""
    found = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((alias.name, top) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                module = child.module or ""
                if child.level:  # relative: resolve against this module's package
                    package = name.split(".") if is_package else name.split(".")[:-1]
                    package = package[: len(package) - (child.level - 1)]
                    module = ".".join(package + ([module] if module else []))
                found.extend((f"{module}.{alias.name}", top) for alias in child.names)
                found.append((module, top))
            visit(child, inner)

    visit(ast.parse(source), True)
    return found


def graph(sources: dict[str, str], is_package=lambda name: False):
    """Edges between modules of `sources` (all imports, and module-level ones) and the
    outside modules each one imports directly."""
    edges: dict[str, set[str]] = {m: set() for m in sources}
    top_edges: dict[str, set[str]] = {m: set() for m in sources}
    outside: dict[str, set[str]] = {m: set() for m in sources}
    for module, source in sources.items():
        for target, top in imports_of(module, source, is_package(module)):
            if target in sources or target.split(".")[0] in {m.split(".")[0] for m in sources}:
                # `from pkg import name`: the submodule when it is one, else the package
                hit = target if target in sources else target.rpartition(".")[0]
                if hit not in sources or hit == module:
                    continue
                edges[module].add(hit)
                if top:
                    top_edges[module].add(hit)
                parts = hit.split(".")  # importing a.b.c runs a/__init__ and a/b/__init__ first
                edges[module].update(p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in sources)
            else:
                outside[module].add(target)
    return edges, top_edges, outside


def closure(start: str, edges: dict[str, set[str]]) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for nxt in edges[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def imports_torch(names: set[str]) -> set[str]:
    return {n for n in names if any(n == t or n.startswith(t + ".") for t in TORCH)}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            strong(v)
    return out


def violations(sources: dict[str, str], is_package=lambda name: False) -> list[str]:
    """Every broken rule of the module docstring, one line each."""
    edges, top_edges, outside = graph(sources, is_package)
    problems = []
    layer = lambda m: "train" if m.split(".")[:2] in (["sprout", "engine"], ["sprout", "stages"], ["sprout", "pipeline"], ["sprout", "train"]) else m.split(".")[0]  # noqa: E731
    for module in sorted(sources):
        reach = closure(module, edges)
        if module.startswith(("sprout.prep", "sprout.formats")):
            for via in sorted(reach):
                for lib in sorted(imports_torch(outside[via])):
                    path = "" if via == module else f" through {via}"
                    problems.append(f"{module} imports {lib}{path}")
        direct = edges[module]
        if layer(module) == "data_loader" and any(layer(t) == "train" for t in reach):
            problems.append(f"{module} imports sprout.train (through {sorted(t for t in reach if layer(t) == 'train')})")
        if layer(module) == "sprout":
            for t in sorted(direct):
                if layer(t) in ("train", "data_loader"):
                    problems.append(f"{module} (core) imports {t}")
        if layer(module) in ("sprout", "data_loader", "train"):
            for t in sorted(direct | outside[module]):
                if t.split(".")[0] in ("scripts", "benchmarks", "tests"):
                    problems.append(f"{module} imports {t}")
    problems += [f"module-level import cycle: {' -> '.join(c)}" for c in cycles(top_edges)]
    return problems


def _is_package(module: str) -> bool:
    base = ROOT / "src" if module.startswith("sprout") else ROOT
    return (base.joinpath(*module.split(".")) / "__init__.py").is_file()


def test_the_repository_follows_the_import_rules():
    sources = read_tree()
    assert {"sprout.prep.pretrain", "sprout.formats.shards", "sprout.engine.loop", "data_loader.tokens"} <= set(sources)
    assert violations(sources, _is_package) == []


def test_the_checker_sees_each_kind_of_violation():
    fake = {
        "sprout": "",
        "sprout.errors": "",
        "sprout.helper": "def f():\n    import torch\n",                   # torch only inside a function
        "sprout.prep": "",
        "sprout.prep.a": "from sprout import helper\n",                      # -> torch through sprout.helper
        "sprout.formats": "",
        "sprout.formats.b": "import numpy\nfrom torch import nn\n",          # torch directly
        "sprout.model": "",
        "sprout.model.c": "from sprout.engine.loop import x\n",               # core -> train
        "sprout.model.d": "import sprout.model.e\n",                         # d <-> e at module level
        "sprout.model.e": "from sprout.model import d\nfrom data_loader import tokens\n",  # core -> data_loader
        "sprout.train": "",
        "sprout.engine.loop": "import accelerate\n",
        "data_loader": "",
        "data_loader.tokens": "def g():\n    from sprout.train import loop\n",   # data_loader -> train
        "scripts.run": "from sprout.engine.loop import x\nimport data_loader.tokens\n",  # fine
    }
    found = violations(fake, lambda m: m in {"sprout", "sprout.prep", "sprout.formats", "sprout.model",
                                             "sprout.train", "data_loader"})
    assert "sprout.prep.a imports torch through sprout.helper" in found
    assert "sprout.formats.b imports torch.nn" in found
    assert "sprout.model.c (core) imports sprout.engine.loop" in found
    assert "sprout.model.e (core) imports data_loader.tokens" in found
    assert any(f.startswith("data_loader.tokens imports sprout.train") for f in found)
    assert "module-level import cycle: sprout.model.d -> sprout.model.e" in found
    assert not any(f.startswith("scripts.run") for f in found)
