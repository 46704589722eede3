"""The import rules of the design (DESIGN.md, Layout) as a test: the core never imports ray,
k3ray.actors or k3ray.evals; kernels import nothing of the project outside k3ray.kernels; actors
never import evals (but the serving benchmark reads the evals' bundled corpus), and its role packages
import one way (openai/ names no Ray and no other role; pipeline/ and cluster/ name no other role;
serve/ may name them; bench/ may name every role, and no role names it); nothing shipped imports the
training program (training/k3ray_training, not in the wheel), which may import k3ray (it trains
k3ray's model) but not Ray or the actors. Every import statement counts, lazy ones inside functions
too, and so does a string that names a module: a dotted one anywhere ("k3ray.actors.serve.cli",
"mod:attr"), a bare one given to an import call (importlib.import_module("ray"), __import__("ray"));
a bare "ray" elsewhere (a dict key, a distribution name for a version lookup) imports nothing and
does not count.

And the shipped modules import each other without a circle, lazy imports included (a
function-level import may keep a heavy or optional dependency out of startup, never hide a circle),
nor do the parts the core and the kernels are made of; each function-level import says why it is
one (a `# lazy:` comment on it or on the imports just above it)."""

from __future__ import annotations

import ast
import graphlib
import pathlib
import re
from dataclasses import dataclass

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# source folder -> the package it installs as (setuptools package-dir), and the training program
# (imported from the checkout: training/ on sys.path)
PACKAGES = {"k3ray": "k3ray", "kernels": "k3ray.kernels", "actors": "k3ray.actors", "evals": "k3ray.evals",
            "training/k3ray_training": "k3ray_training"}
TRAINING = "k3ray_training"
MODULE_STRING = re.compile(r"^(?P<module>(ray|k3ray|k3ray_training)(\.[A-Za-z_]\w*)*)(:[A-Za-z_]\w*)?$")
IMPORT_CALLS = {"import_module", "__import__", "find_spec", "import_string"}


@dataclass(frozen=True)
class Rule:
    package: str  # whose files the rule reads
    forbidden: tuple[str, ...]  # module prefixes they may not name
    allowed: tuple[str, ...] = ()  # exceptions to `forbidden` (longest prefix wins)


CORE_FORBIDDEN = ("ray", "k3ray.actors", "k3ray.evals", TRAINING)
ENGINE_TOP = ("k3ray.engine.llm_engine", "k3ray.engine.async_engine", "k3ray.engine.llm",
              "k3ray.engine.step_or_abort")

RULES = (
    Rule("k3ray", forbidden=CORE_FORBIDDEN),
    Rule("k3ray.kernels", forbidden=("k3ray", TRAINING), allowed=("k3ray.kernels",)),
    Rule("k3ray.actors", forbidden=("k3ray.evals", TRAINING)),
    Rule("k3ray.evals", forbidden=(TRAINING,)),
    Rule(TRAINING, forbidden=("ray", "k3ray.actors")),  # in-process training of k3ray's own model
    # actors/ by role, imports one way: serve -> openai, pipeline, cluster; bench -> any of them
    Rule("k3ray.actors.openai", forbidden=("ray", "k3ray.actors", "k3ray.evals", TRAINING),
         allowed=("k3ray.actors.openai",)),
    Rule("k3ray.actors.pipeline", forbidden=("k3ray.actors", "k3ray.evals", TRAINING), allowed=("k3ray.actors.pipeline",)),
    Rule("k3ray.actors.cluster", forbidden=("k3ray.actors", "k3ray.evals", TRAINING),
         allowed=("k3ray.actors.cluster", "k3ray.actors.serve.config")),  # the settings it checks nodes for
    Rule("k3ray.actors.serve", forbidden=("k3ray.actors.bench", "k3ray.evals", TRAINING)),
    # engine/ by role: the rooms serve the engine's top (LLMEngine, its fronts), which alone ties them together;
    # process/ runs the engine in its own process; the scheduler and caches (core/) name no grammar, sampler or input
    *(Rule(f"k3ray.engine.{room}", forbidden=(*CORE_FORBIDDEN, *ENGINE_TOP, "k3ray.engine.process"))
      for room in ("execution", "sample", "structured", "media", "disagg")),
    Rule("k3ray.engine.core", forbidden=(*CORE_FORBIDDEN, *ENGINE_TOP, "k3ray.engine.process",
                                         "k3ray.engine.structured", "k3ray.engine.sample",
                                         "k3ray.engine.input_processor", "k3ray.engine.output_processor")),
    Rule("k3ray.engine.process", forbidden=CORE_FORBIDDEN),
    Rule("k3ray.actors.bench", forbidden=("k3ray.evals", TRAINING),
         allowed=("k3ray.evals.haystack", "k3ray.evals.extra")),  # bench serve --dataset long: the bundled corpus
)


@dataclass(frozen=True)
class Reference:
    module: str
    line: int
    how: str  # "import" or "string"


def module_name(path: pathlib.Path) -> str:
    folder = next(f for f in PACKAGES if path.is_relative_to(ROOT / f))
    parts = [PACKAGES[folder], *path.relative_to(ROOT / folder).parts]
    parts[-1] = parts[-1].removesuffix(".py")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def references(source: str, module: str, is_package: bool = False) -> list[Reference]:
    """Every module the source names: absolute and relative imports at any depth, and strings."""
    tree = ast.parse(source)
    imported_names = {id(arg) for node in ast.walk(tree) if isinstance(node, ast.Call)
                      and _call_name(node) in IMPORT_CALLS for arg in node.args}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [Reference(alias.name, node.lineno, "import") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node, module, is_package)
            found.append(Reference(base, node.lineno, "import"))
            found += [Reference(f"{base}.{alias.name}", node.lineno, "import") for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            match = MODULE_STRING.match(node.value.strip())
            if match and (id(node) in imported_names or any(c in node.value for c in ".:")):
                found.append(Reference(match.group("module"), node.lineno, "string"))
    return sorted(found, key=lambda r: (r.line, r.module))


def _call_name(call: ast.Call) -> str | None:
    return getattr(call.func, "id", None) or getattr(call.func, "attr", None)


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    anchor = parts if is_package else parts[:-1]
    anchor = anchor[: len(anchor) - (node.level - 1)]
    return ".".join([*anchor, *([node.module] if node.module else [])])


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def violations(rule: Rule, refs: list[Reference]) -> list[Reference]:
    bad = []
    for ref in refs:
        hit = max((p for p in rule.forbidden if _under(ref.module, p)), key=len, default=None)
        ok = max((p for p in rule.allowed if _under(ref.module, p)), key=len, default=None)
        if hit is not None and (ok is None or len(ok) < len(hit)):
            bad.append(ref)
    return bad


def package_of(module: str) -> str:
    """The most specific ruled package a module belongs to (k3ray.kernels.x is a kernel, not core)."""
    for name in sorted({rule.package for rule in RULES} | {"k3ray.evals"}, key=len, reverse=True):
        if _under(module, name):
            return name
    return "k3ray"


def source_files() -> list[pathlib.Path]:
    files = [f for folder in PACKAGES for f in sorted((ROOT / folder).rglob("*.py"))]
    return [f for f in files if "__pycache__" not in f.parts]


def lazy_names(tree: ast.Module) -> dict[str, str]:
    """A package's names imported on first use (a PEP 562 `__getattr__` over a {name: submodule} dict)."""
    if not any(isinstance(node, ast.FunctionDef) and node.name == "__getattr__" for node in tree.body):
        return {}
    return {k.value: v.value for node in tree.body if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
            for k, v in zip(node.value.keys, node.value.values)
            if isinstance(k, ast.Constant) and isinstance(v, ast.Constant) and isinstance(v.value, str)}


def executed_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: at any depth, but not under `if TYPE_CHECKING:`."""
    found, todo = [], [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo += node.orelse
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        todo += ast.iter_child_nodes(node)
    return found


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """module -> the modules among `sources` (module -> (source, is_package)) that its imports load:
    importing a.b.c loads a and a.b too, except the packages the importer is inside (already loading);
    a name a package imports on first use loads the submodule that holds it."""
    trees = {module: ast.parse(source) for module, (source, _) in sources.items()}
    lazy = {module: lazy_names(tree) for module, tree in trees.items() if sources[module][1]}
    graph = {}
    for module, tree in trees.items():
        targets = []
        for node in executed_imports(tree):
            if isinstance(node, ast.Import):
                targets += [alias.name for alias in node.names]
                continue
            base = _resolve(node, module, sources[module][1])
            targets.append(base)
            targets += [f"{base}.{lazy.get(base, {}).get(alias.name, alias.name)}" for alias in node.names]
        loaded = {".".join(t.split(".")[:i]) for t in targets for i in range(1, t.count(".") + 2)}
        graph[module] = {m for m in loaded if m in sources and not _under(module, m)}
    return graph


def test_the_tree_has_the_five_packages_and_no_links_inside_the_core():
    assert len(source_files()) > 150
    assert not [p for p in (ROOT / "k3ray").iterdir() if p.is_symlink()], "k3ray/ holds a symlink: package-dir is the one mechanism"


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.package)
def test_import_rules_hold(rule):
    problems = []
    for path in source_files():
        module = module_name(path)
        if package_of(module) != rule.package:
            continue
        refs = references(path.read_text(), module, path.name == "__init__.py")
        problems += [f"{path.relative_to(ROOT)}:{r.line}: {r.how} of {r.module}" for r in violations(rule, refs)]
    assert not problems, f"{rule.package} may not name {rule.forbidden}:\n" + "\n".join(problems)


def part_of(module: str) -> str:
    """The folder or module directly under the core or the kernels that a module belongs to."""
    depth = 3 if _under(module, "k3ray.kernels") else 2
    return ".".join(module.split(".")[:depth])


def parts_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    parts: dict[str, set[str]] = {}
    for module, imported in graph.items():
        parts.setdefault(part_of(module), set()).update(part_of(m) for m in imported if part_of(m) != part_of(module))
    return parts


def circle(graph: dict[str, set[str]]) -> str | None:
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        return " -> ".join(e.args[1])
    return None


def shipped_sources() -> dict[str, tuple[str, bool]]:
    return {module_name(path): (path.read_text(), path.name == "__init__.py") for path in source_files()
            if package_of(module_name(path)) != TRAINING}


def test_the_shipped_modules_import_without_a_circle():
    """Every module of the wheel, lazy imports included: moving a lazy import to the top of its
    module can never make an import fail half way."""
    sources = shipped_sources()
    assert len(sources) > 200
    graph = import_graph(sources)
    assert circle(graph) is None, f"import circle between modules: {circle(graph)}"


def test_the_parts_of_the_core_and_the_kernels_import_without_a_circle():
    """Between the parts the core and the kernels are made of (k3ray.weights, k3ray.default_model, ...)."""
    sources = {m: s for m, s in shipped_sources().items() if package_of(m) in ("k3ray", "k3ray.kernels")}
    assert len(sources) > 100
    parts = parts_graph(import_graph(sources))
    assert circle(parts) is None, f"import circle between parts of the core: {circle(parts)}"


def unexplained_lazy_imports(source: str) -> list[int]:
    """Lines of function-level imports without a `# lazy:` reason on them or on the comments and
    imports directly above them (one reason may head a group of lazy imports)."""
    tree = ast.parse(source)
    lines = source.splitlines()
    lazy = [node for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
            for node in ast.walk(fn) if isinstance(node, (ast.Import, ast.ImportFrom))]
    import_lines = {n for node in lazy for n in range(node.lineno, node.end_lineno + 1)}
    missing = []
    for node in lazy:
        n = node.end_lineno
        while n >= 1 and "# lazy:" not in lines[n - 1]:
            text = lines[n - 1].strip()
            if n < node.lineno and not (n in import_lines or text.startswith("#") or not text):
                break
            n -= 1
        if n < 1 or "# lazy:" not in lines[n - 1]:
            missing.append(node.lineno)
    return sorted(set(missing))


def test_every_function_level_import_says_why():
    problems = [f"{path.relative_to(ROOT)}:{line}" for path in source_files()
                if package_of(module_name(path)) != TRAINING for line in unexplained_lazy_imports(path.read_text())]
    assert not problems, ("function-level imports keep a heavy or optional dependency out of startup, with a "
                          "`# lazy: why` comment; move these to the top of their modules or say why:\n"
                          + "\n".join(problems))


def test_the_lazy_import_check_reads_groups_and_stops_at_code():
    source = ("import os\n"
              "def f():\n"
              "    # lazy: torch stays out of `k3ray --help`\n"
              "    import torch\n"
              "\n"
              "    from k3ray.models import (\n"
              "        init)\n"
              "    x = 1\n"
              "    import json\n"
              "    import ray  # lazy: Ray only for the ray executor\n"
              "def g():\n"
              "    import time\n")
    assert unexplained_lazy_imports(source) == [9, 12]


def test_the_circle_check_sees_lazy_imports_and_names_a_package_loads_on_first_use():
    """The two circles it was written for: sampling_params -> (lazily) a module of the engine package,
    whose __init__ loads structured_output -> sampling_params; and checkpoints -> (lazily) default_model
    -> weights' save_checkpoint (loaded from a submodule on first use), whose package's loader ->
    checkpoints: no module imports itself back, the parts do."""
    sources = {
        "k3ray.sampling_params": ("def validate():\n    from k3ray.engine.strict_json import checked_schema\n", False),
        "k3ray.engine": ("from k3ray.engine.structured.structured_output import compile\n", True),
        "k3ray.engine.structured.structured_output": ("from k3ray.sampling_params import SamplingParams\n", False),
        "k3ray.engine.strict_json": ("import re\n", False),
    }
    assert import_graph(sources)["k3ray.sampling_params"] == {"k3ray.engine", "k3ray.engine.strict_json"}
    assert circle(import_graph(sources))
    weights = ('import importlib\n_HOME = {"save_checkpoint": "writer", "load_model": "loader"}\n'
               'def __getattr__(name):\n    return importlib.import_module(f"{__name__}.{_HOME[name]}")\n')
    sources = {
        "k3ray.checkpoints": ("def checkpoint_dir():\n    from k3ray.default_model import default_dir\n", True),
        "k3ray.default_model": ("from k3ray.weights import save_checkpoint\n", False),
        "k3ray.weights": (weights, True),
        "k3ray.weights.writer": ("import os\n", False),
        "k3ray.weights.loader": ("from k3ray.checkpoints import checkpoint_dir\n", False),
    }
    assert import_graph(sources)["k3ray.default_model"] == {"k3ray.weights", "k3ray.weights.writer"}
    assert circle(import_graph(sources)) is None
    assert circle(parts_graph(import_graph(sources)))
    typing_only = {"k3ray.a": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import k3ray.b\n", False),
                   "k3ray.b": ("import k3ray.a\n", False)}
    assert circle(import_graph(typing_only)) is None
    assert part_of("k3ray.weights.loader") == "k3ray.weights" and part_of("k3ray.kernels.kda.naive") == "k3ray.kernels.kda"


def test_the_checker_sees_lazy_relative_and_string_imports():
    source = (
        "import os\n"
        "def f():\n"
        "    import ray.util\n"
        "    from ..actors.pipeline import stage\n"
        "    return importlib.import_module('k3ray.evals.cli'), 'k3ray.actors.serve.cli:main', 'the ray docs'\n"
        "metadata.version('ray'); __import__('ray'); info['ray'] = 1\n"
    )
    refs = references(source, "k3ray.engine.llm")
    core = RULES[0]
    assert [(r.module, r.line, r.how) for r in violations(core, refs)] == [
        ("ray.util", 3, "import"), ("k3ray.actors.pipeline", 4, "import"), ("k3ray.actors.pipeline.stage", 4, "import"),
        ("k3ray.actors.serve.cli", 5, "string"), ("k3ray.evals.cli", 5, "string"), ("ray", 6, "string"),
    ]
    kernels = RULES[1]
    kernel_refs = references("from k3ray.kernels.kda import naive\nfrom k3ray.config import X\nfrom . import y\n",
                             "k3ray.kernels.mla.dispatch")
    assert [r.module for r in violations(kernels, kernel_refs)] == ["k3ray.config", "k3ray.config.X"]
    assert not violations(RULES[2], references("import k3ray.engine\nimport ray\n", "k3ray.actors.pipeline.stage"))
    shipped_refs = references("def f():\n    from k3ray_training.model import niah_config\n"
                              "x = 'k3ray_training.train:main'\n", "k3ray.evals.cli")
    assert [r.module for r in violations(RULES[3], shipped_refs)] == [
        "k3ray_training.model", "k3ray_training.model.niah_config", "k3ray_training.train"]
    training_refs = references("from k3ray.models.k3 import K3ForCausalLM\nfrom k3ray.evals.tasks import get_task\n"
                               "import ray\n", "k3ray_training.train")
    assert [r.module for r in violations(RULES[4], training_refs)] == ["ray"]


def test_module_names_follow_the_package_dir_mapping():
    assert module_name(ROOT / "kernels" / "kda" / "naive.py") == "k3ray.kernels.kda.naive"
    assert module_name(ROOT / "actors" / "__init__.py") == "k3ray.actors"
    assert module_name(ROOT / "k3ray" / "engine" / "llm.py") == "k3ray.engine.llm"
    assert package_of("k3ray.engine.llm") == "k3ray" and package_of("k3ray.kernels.moe") == "k3ray.kernels"
    assert package_of("k3ray.actors.openai.routes") == "k3ray.actors.openai" and package_of("k3ray.actors") == "k3ray.actors"
    assert module_name(ROOT / "training" / "k3ray_training" / "train.py") == "k3ray_training.train"
    assert package_of("k3ray_training.model") == TRAINING
