"""RULER's string-match scores: references are looked up case-insensitively in the prediction."""

from __future__ import annotations

from collections.abc import Sequence

METRICS = ("all", "part")


def _normalise(text: str) -> str:
    return " ".join(text.split()).lower()


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """Fraction of the references found in the prediction (RULER's `string_match_all`, per sample)."""
    if not references:
        raise ValueError("references must not be empty")
    found = _normalise(prediction)
    return sum(_normalise(ref) in found for ref in references) / len(references)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """1.0 when any reference is found in the prediction, else 0.0 (RULER's `string_match_part`)."""
    if not references:
        raise ValueError("references must not be empty")
    found = _normalise(prediction)
    return float(any(_normalise(ref) in found for ref in references))


def score(prediction: str, references: Sequence[str], metric: str) -> float:
    if metric == "all":
        return string_match_all(prediction, references)
    if metric == "part":
        return string_match_part(prediction, references)
    raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
