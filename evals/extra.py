"""The `eval` extra (pyproject's `[eval]`): the packages `k3ray eval` imports, which a serving
install (`pip install k3ray`: serve, generate, info, plan, bench) does without. `k3ray eval` (and
`k3ray bench serve --dataset long`, whose haystack `datasets` reads) checks them before it starts, so
a serving install ends it with one line naming the extra instead of a traceback from deep inside a run."""

from __future__ import annotations

from importlib.util import find_spec

EVAL_MODULES = ("datasets", "lm_eval", "matplotlib", "tqdm")  # top-level import names of the extra's packages
INSTALL = "pip install 'k3ray[eval]'"


def missing_eval_modules(needed: tuple[str, ...] = EVAL_MODULES) -> list[str]:
    return [name for name in needed if find_spec(name) is None]


def require_eval_extra(what: str = "k3ray eval", needed: tuple[str, ...] = EVAL_MODULES) -> None:
    """ValueError (one line: what is missing and the install command) unless `needed` is installed."""
    missing = missing_eval_modules(needed)
    if missing:
        raise ValueError(f"{what} needs the eval extra ({', '.join(missing)} not installed): {INSTALL}")
