"""The import rules of the repository, read from the source with `ast` (no module is imported).

Every import statement counts, at module level or inside a function, and so do the package
`__init__`s that importing a module runs. Each rule is a named check (`RULES`); a violation is
one line that starts with the rule's name:
- layers: every module stands in one layer of `LAYERS` (lowest first) and imports only modules
  of its own layer or a lower one; a module in no layer is a violation too;
- prep and formats never reach torch (nor accelerate or safetensors.torch), at any depth; nor
  do the modules a trainer's --help imports (`TORCH_FREE`), so --help runs without loading it;
- at any depth: the engine never imports a stage; checkpoint I/O never imports `sprout.model`;
  formats import only the formats, text and base layers;
- no import cycles (function-level imports counted), between modules or between packages
  (each `sprout.X`, `data_loader` and `scripts` one node);
- no cross-module private names (`_name`) within sprout, data_loader and scripts;
- nothing in sprout or data_loader imports scripts, benchmarks or tests.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
TORCH = ("torch", "accelerate", "safetensors.torch")
TORCH_FREE = ("sprout.model.config", "sprout.losses.loss_types", "sprout.engine.configs", "sprout.engine.cli",
              "sprout.stages.configs")
LAYERS = (
    ("base", ("sprout", "sprout.errors", "sprout.atomic", "sprout.locks", "sprout.ranges", "sprout.option_names",
              "sprout.config", "sprout.config_help", "sprout.mirror", "sprout.answers")),
    ("text", ("sprout.tokenizer", "sprout.tokenizer_files", "sprout.chat_formats", "sprout.chat", "sprout.chat_detect",
              "sprout.bpb")),
    ("formats", ("sprout.formats",)),
    ("prep", ("sprout.prep",)),
    ("checkpoint", ("sprout.checkpoint", "sprout.lora_weights")),
    ("model", ("sprout.model", "sprout.losses")),
    ("rl", ("sprout.rl",)),
    ("evaluation", ("sprout.evaluation",)),
    ("data_loader", ("data_loader",)),
    ("engine", ("sprout.engine",)),
    ("stages", ("sprout.stages",)),
    ("pipeline", ("sprout.pipeline",)),
    ("scripts", ("scripts",)),
)
LAYERS_RULE = "layers"
TORCH_RULE = "prep and formats never reach torch"
CONFIG_RULE = "a trainer's configs and command line never reach torch"
ENGINE_RULE = "the engine never imports a stage"
CHECKPOINT_RULE = "checkpoint I/O never imports the model"
FORMATS_RULE = "formats import nothing above them"
CYCLE_RULE = "no import cycles (function-level imports counted)"
PRIVATE_RULE = "no cross-module private names"
OUTSIDE_RULE = "nothing in sprout or data_loader imports scripts, benchmarks or tests"
RULES = (LAYERS_RULE, TORCH_RULE, CONFIG_RULE, ENGINE_RULE, CHECKPOINT_RULE, FORMATS_RULE, CYCLE_RULE, PRIVATE_RULE,
         OUTSIDE_RULE)


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


class Import(NamedTuple):
    module: str       # the dotted module named by the statement (relative imports resolved)
    name: str | None  # the name taken from it (`from module import name`), None for `import module`


def imports_of(name: str, source: str, is_package: bool) -> list[Import]:
    """Every import statement of `source`, at any depth (inside functions and classes too)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend(Import(alias.name, None) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: resolve against this module's package
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                module = ".".join(package + ([module] if module else []))
            found.extend(Import(module, alias.name) for alias in node.names)
    return found


def graph(sources: dict[str, str], is_package=lambda name: False):
    """(edges, named): the modules of `sources` each one imports (with the packages whose
    `__init__` that runs), and every dotted name each one imports (`module.name` for a
    `from module import name`), in the tree or not."""
    roots = {m.split(".")[0] for m in sources}
    edges: dict[str, set[str]] = {m: set() for m in sources}
    named: dict[str, set[str]] = {m: set() for m in sources}
    for module, source in sources.items():
        for imp in imports_of(module, source, is_package(module)):
            target = f"{imp.module}.{imp.name}" if imp.name else imp.module
            named[module].add(target)
            if imp.module.split(".")[0] not in roots:
                continue
            # `from pkg import name`: the submodule when it is one, else the module itself
            hit = target if target in sources else imp.module
            if hit in sources and hit != module:
                edges[module].add(hit)
            parts = hit.split(".")  # importing a.b.c runs a/__init__ and a/b/__init__ first
            edges[module].update(p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in sources)
    return edges, named


def private_imports(sources: dict[str, str], is_package=lambda name: False) -> list[tuple[str, Import]]:
    """(importer, import) for every `_name` one module of the tree takes from another."""
    roots = {m.split(".")[0] for m in sources}
    found = []
    for module, source in sources.items():
        for imp in imports_of(module, source, is_package(module)):
            private = imp.name and imp.name.startswith("_") and not imp.name.endswith("__")
            if private and imp.module.split(".")[0] in roots and imp.module != module:
                found.append((module, imp))
    return found


def paths_from(start: str, edges: dict[str, set[str]]) -> dict[str, list[str]]:
    """Every module `start` reaches -> one shortest chain of imports from `start` to it."""
    paths, todo = {start: [start]}, [start]
    while todo:
        here = todo.pop(0)
        for nxt in sorted(edges[here]):
            if nxt not in paths:
                paths[nxt] = paths[here] + [nxt]
                todo.append(nxt)
    return paths


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
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


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def layer_of(module: str) -> int | None:
    """Index in LAYERS of the longest name that is `module` or a package holding it (the bare
    `sprout` names the package itself, not what it holds); None when no layer names it."""
    best, length = None, -1
    for i, (_, names) in enumerate(LAYERS):
        for name in names:
            holds = module == name or (name != "sprout" and module.startswith(name + "."))
            if holds and len(name) > length:
                best, length = i, len(name)
    return best


def package_of(module: str) -> str:
    """The node a module counts as in package cycles: `sprout.X` for `sprout.X.*`, else its top name."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "sprout" else parts[0]


def violations(sources: dict[str, str], is_package=lambda name: False) -> list[str]:
    """Every broken rule of the module docstring, one line each, starting with the rule's name."""
    edges, named = graph(sources, is_package)
    name_of = lambda m: LAYERS[layer_of(m)][0] if layer_of(m) is not None else "no layer"  # noqa: E731
    formats_layer = next(i for i, (name, _) in enumerate(LAYERS) if name == "formats")
    problems = []

    def reaching(module: str, hit, rule: str) -> None:
        """One line for every module `module` reaches (itself excluded) for which `hit` holds."""
        for target, path in sorted(paths_from(module, edges).items()):
            if target != module and hit(target):
                through = f" (through {' -> '.join(path[1:-1])})" if len(path) > 2 else ""
                problems.append(f"{rule}: {module} imports {target}{through}")

    for module in sorted(sources):
        level = layer_of(module)
        if level is None:
            problems.append(f"{LAYERS_RULE}: {module} is in no layer")
        else:
            for target in sorted(edges[module]):
                if layer_of(target) is None or layer_of(target) > level:
                    problems.append(f"{LAYERS_RULE}: {module} ({name_of(module)}) imports {target} ({name_of(target)})")
        torch_free = TORCH_RULE if within(module, "sprout.prep") or within(module, "sprout.formats") else \
            CONFIG_RULE if any(within(module, name) for name in TORCH_FREE) else None
        if torch_free:
            for via, path in sorted(paths_from(module, edges).items()):
                for lib in sorted(t for t in named[via] if any(within(t, torch) for torch in TORCH)):
                    through = "" if via == module else f" through {' -> '.join(path[1:])}"
                    problems.append(f"{torch_free}: {module} imports {lib}{through}")
        if within(module, "sprout.engine"):
            reaching(module, lambda t: within(t, "sprout.stages"), ENGINE_RULE)
        if within(module, "sprout.checkpoint"):
            reaching(module, lambda t: within(t, "sprout.model"), CHECKPOINT_RULE)
        if within(module, "sprout.formats"):
            reaching(module, lambda t: layer_of(t) is None or layer_of(t) > formats_layer, FORMATS_RULE)
        if module.split(".")[0] in ("sprout", "data_loader"):
            for target in sorted(named[module]):
                if target.split(".")[0] in ("scripts", "benchmarks", "tests"):
                    problems.append(f"{OUTSIDE_RULE}: {module} imports {target}")
    problems += [f"{CYCLE_RULE}: modules {' <-> '.join(c)}" for c in cycles(edges)]
    packages: dict[str, set[str]] = {package_of(m): set() for m in sources}
    for module, targets in edges.items():
        packages[package_of(module)].update(package_of(t) for t in targets if package_of(t) != package_of(module))
    problems += [f"{CYCLE_RULE}: packages {' <-> '.join(c)}" for c in cycles(packages)]
    problems += [f"{PRIVATE_RULE}: {module} imports {imp.name} from {imp.module}"
                 for module, imp in private_imports(sources, is_package)]
    return problems


def _is_package(module: str) -> bool:
    base = ROOT / "src" if module.startswith("sprout") else ROOT
    return (base.joinpath(*module.split(".")) / "__init__.py").is_file()


def test_the_repository_follows_the_import_rules():
    sources = read_tree()
    assert {"sprout.prep.pretrain", "sprout.formats.shards", "sprout.engine.trainer", "sprout.answers",
            "sprout.model.load", "data_loader.token_batches", "scripts.pretrain"} <= set(sources)
    assert violations(sources, _is_package) == []


FAKE_PACKAGES = {"sprout", "sprout.prep", "sprout.formats", "sprout.model", "sprout.losses", "sprout.engine",
                 "sprout.stages", "data_loader"}
CLEAN_TREE = {
    "sprout": "",
    "sprout.errors": "",
    "sprout.answers": "import re\nfrom fractions import Fraction\n",
    "sprout.bpb": "import torch\n",
    "sprout.chat": "from sprout import errors\n",
    "sprout.formats": "",
    "sprout.formats.jsonl": "from sprout.answers import parse\nfrom sprout.chat import render\n",
    "sprout.formats.verify": "from . import jsonl\n",
    "sprout.prep": "",
    "sprout.prep.a": "import numpy\nfrom sprout.formats.jsonl import write\n\ndef f():\n    from sprout.prep import b\n",
    "sprout.prep.b": "from sprout import __version__\n\ndef _own():\n    pass\n",
    "sprout.checkpoint": "import torch\nfrom sprout.errors import SproutError\n",
    "sprout.model": "",
    "sprout.model.load": "import torch\nfrom sprout.checkpoint import read_meta\nfrom sprout.losses import tokens\n",
    "sprout.losses": "",
    "sprout.losses.tokens": "import torch\n",
    "sprout.engine": "",
    "sprout.engine.trainer": "import accelerate\nfrom sprout.checkpoint import read_meta\n\ndef f():\n    from sprout.formats import jsonl\n",
    "sprout.engine.training_loop": "import tqdm\nfrom sprout.engine.trainer import Trainer\n",
    "sprout.engine.configs": "import dataclasses\nfrom sprout.answers import parse\n",
    "sprout.stages": "",
    "sprout.stages.sft": "from sprout.engine.training_loop import fit\nfrom sprout.model.load import load_model\n",
    "data_loader": "",
    "data_loader.token_batches": "import torch\nfrom sprout.formats.jsonl import read\n",
    "scripts.train": "import data_loader.token_batches\nfrom sprout.stages.sft import run\n",
}


def test_a_clean_tree_has_no_violations():
    assert violations(CLEAN_TREE, lambda m: m in FAKE_PACKAGES) == []


def test_the_checker_sees_each_kind_of_violation():
    fake = dict(CLEAN_TREE)
    fake.update({
        "sprout.bpb": "def f():\n    import torch\n",                          # torch only inside a function
        "sprout.prep.a": "from sprout import bpb\n",                             # -> torch through sprout.bpb
        "sprout.prep.c": "from sprout.prep.b import _own\n",                     # a private name of another module
        "sprout.formats.b": "import numpy\nfrom torch import nn\n",              # torch directly
        "sprout.formats.c": "def f():\n    from sprout.prep import a\n",         # formats -> prep (and torch)
        "sprout.checkpoint": "def load():\n    from sprout.model.heads import x\n",  # checkpoint I/O -> model,
        "sprout.model.heads": "import torch\n",                                  # and sprout.model.load imports
        "sprout.model.d": "import sprout.model.e\nfrom sprout.rl.kl import x\n",  # the checkpoint: a package loop
        "sprout.model.e": "def f():\n    from sprout.model import d\n",        # d <-> e, one side in a function
        "sprout.rl": "",
        "sprout.rl.kl": "import torch\n",
        "sprout.engine.report": "def f():\n    from sprout.stages import sft\n",  # the engine -> a stage
        "sprout.engine.configs": "from sprout.engine.training_loop import fit\n",          # -> accelerate through the loop
        "sprout.unplaced": "",                                                   # in no layer
        "scripts.train": "",
        "data_loader.token_batches": "from tests.fixtures import tiny\nimport scripts.train\n",
    })
    found = violations(fake, lambda m: m in FAKE_PACKAGES | {"sprout.rl", "sprout.unplaced"})
    assert {line.partition(":")[0] for line in found} == set(RULES)
    assert f"{LAYERS_RULE}: sprout.model.d (model) imports sprout.rl.kl (rl)" in found
    assert f"{LAYERS_RULE}: sprout.formats.c (formats) imports sprout.prep.a (prep)" in found
    assert f"{LAYERS_RULE}: data_loader.token_batches (data_loader) imports scripts.train (scripts)" in found
    assert f"{LAYERS_RULE}: sprout.unplaced is in no layer" in found
    assert f"{TORCH_RULE}: sprout.prep.a imports torch through sprout.bpb" in found
    assert f"{TORCH_RULE}: sprout.formats.b imports torch.nn" in found
    assert f"{TORCH_RULE}: sprout.formats.c imports torch through sprout.prep.a -> sprout.bpb" in found
    assert f"{CONFIG_RULE}: sprout.engine.configs imports accelerate through sprout.engine.training_loop -> sprout.engine.trainer" \
        in found
    assert f"{ENGINE_RULE}: sprout.engine.report imports sprout.stages.sft" in found
    assert f"{CHECKPOINT_RULE}: sprout.checkpoint imports sprout.model.heads" in found
    assert f"{FORMATS_RULE}: sprout.formats.c imports sprout.prep.a" in found
    assert not any(line.startswith(f"{FORMATS_RULE}: sprout.formats.c imports sprout.bpb") for line in found)  # text
    assert f"{CYCLE_RULE}: modules sprout.model.d <-> sprout.model.e" in found
    assert f"{CYCLE_RULE}: packages sprout.checkpoint <-> sprout.model" in found
    assert f"{CYCLE_RULE}: packages sprout.engine <-> sprout.stages" in found
    assert f"{PRIVATE_RULE}: sprout.prep.c imports _own from sprout.prep.b" in found
    assert f"{OUTSIDE_RULE}: data_loader.token_batches imports tests.fixtures.tiny" in found
    assert f"{OUTSIDE_RULE}: data_loader.token_batches imports scripts.train" in found
