"""The `eval` extra (pyproject's `[eval]`): the packages only `k3ray eval` imports, which a serving
install (`pip install k3ray`: serve, generate, info, plan, bench) does without. `k3ray eval` checks
them before it starts, so a serving install ends it with one line naming the extra instead of a
traceback from deep inside a run."""

from __future__ import annotations

from importlib.util import find_spec

EVAL_MODULES = ("datasets", "lm_eval", "matplotlib", "tqdm")  # top-level import names of the extra's packages
INSTALL = "pip install 'k3ray[eval]'"


def missing_eval_modules() -> list[str]:
    return [name for name in EVAL_MODULES if find_spec(name) is None]


def require_eval_extra() -> None:
    """ValueError (one line: what is missing and the install command) unless the extra is installed."""
    missing = missing_eval_modules()
    if missing:
        raise ValueError(f"k3ray eval needs the eval extra, and {', '.join(missing)} "
                         f"{'is' if len(missing) == 1 else 'are'} not installed: {INSTALL}")
