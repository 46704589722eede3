"""The import rules of the design (DESIGN.md, Layout) as a test: the core never imports ray,
k3ray.actors or k3ray.evals; kernels import nothing of the project outside k3ray.kernels; actors
never import evals, and its role packages import one way (openai/ names no Ray and no other role;
pipeline/ and cluster/ name no other role; serve/ may name them). Every import statement counts, lazy ones inside functions too, and so does a
string that names a module: a dotted one anywhere ("k3ray.actors.serve.cli", "mod:attr"), a bare one
given to an import call (importlib.import_module("ray"), __import__("ray")); a bare "ray" elsewhere
(a dict key, a distribution name for a version lookup) imports nothing and does not count."""

from __future__ import annotations

import ast
import pathlib
import re
from dataclasses import dataclass

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# source folder -> the package it installs as (setuptools package-dir)
PACKAGES = {"k3ray": "k3ray", "kernels": "k3ray.kernels", "actors": "k3ray.actors", "evals": "k3ray.evals"}
MODULE_STRING = re.compile(r"^(?P<module>(ray|k3ray)(\.[A-Za-z_]\w*)*)(:[A-Za-z_]\w*)?$")
IMPORT_CALLS = {"import_module", "__import__", "find_spec", "import_string"}


@dataclass(frozen=True)
class Rule:
    package: str  # whose files the rule reads
    forbidden: tuple[str, ...]  # module prefixes they may not name
    allowed: tuple[str, ...] = ()  # exceptions to `forbidden` (longest prefix wins)


RULES = (
    Rule("k3ray", forbidden=("ray", "k3ray.actors", "k3ray.evals")),
    Rule("k3ray.kernels", forbidden=("k3ray",), allowed=("k3ray.kernels",)),
    Rule("k3ray.actors", forbidden=("k3ray.evals",)),
    # actors/ by role, imports one way: serve -> openai, pipeline, cluster; bench -> pipeline
    Rule("k3ray.actors.openai", forbidden=("ray", "k3ray.actors", "k3ray.evals"), allowed=("k3ray.actors.openai",)),
    Rule("k3ray.actors.pipeline", forbidden=("k3ray.actors", "k3ray.evals"), allowed=("k3ray.actors.pipeline",)),
    Rule("k3ray.actors.cluster", forbidden=("k3ray.actors", "k3ray.evals"),
         allowed=("k3ray.actors.cluster", "k3ray.actors.serve.config")),  # the settings it checks nodes for
    Rule("k3ray.actors.serve", forbidden=("k3ray.actors.bench", "k3ray.evals")),
    Rule("k3ray.actors.bench", forbidden=("k3ray.actors.serve", "k3ray.actors.openai", "k3ray.evals")),
)


@dataclass(frozen=True)
class Reference:
    module: str
    line: int
    how: str  # "import" or "string"


def module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT)
    parts = [PACKAGES[rel.parts[0]], *rel.parts[1:]]
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


def test_the_tree_has_the_four_packages_and_no_links_inside_the_core():
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


def test_module_names_follow_the_package_dir_mapping():
    assert module_name(ROOT / "kernels" / "kda" / "naive.py") == "k3ray.kernels.kda.naive"
    assert module_name(ROOT / "actors" / "__init__.py") == "k3ray.actors"
    assert module_name(ROOT / "k3ray" / "engine" / "llm.py") == "k3ray.engine.llm"
    assert package_of("k3ray.engine.llm") == "k3ray" and package_of("k3ray.kernels.moe") == "k3ray.kernels"
    assert package_of("k3ray.actors.openai.routes") == "k3ray.actors.openai" and package_of("k3ray.actors") == "k3ray.actors"
