"""Tokenizer file formats: JSON configs and tiktoken BPE rank files ("<base64 token> <rank>" per line)."""

from __future__ import annotations

import base64
import json
from pathlib import Path


def read_json(path: Path) -> dict:
    """A JSON object from path, with a ValueError naming the file when it is missing or malformed."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


def write_json(path: Path, value: dict) -> None:
    Path(path).write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def read_bpe_ranks(path: Path) -> dict[bytes, int]:
    """Token bytes -> rank from a local tiktoken rank file (never fetched)."""
    ranks: dict[bytes, int] = {}
    try:
        lines = Path(path).read_bytes().splitlines()
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist") from None
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        parsed = _parse_rank_line(line)
        if parsed is None:
            raise ValueError(f"{path}:{line_number}: expected '<base64 token> <rank>', got {line[:80]!r}")
        token, rank = parsed
        if token in ranks:
            raise ValueError(f"{path}:{line_number}: token {token!r} appears twice")
        ranks[token] = rank
    return ranks


def write_bpe_ranks(path: Path, ranks: dict[bytes, int]) -> None:
    by_rank = sorted(ranks.items(), key=lambda kv: kv[1])
    lines = [f"{base64.b64encode(token).decode('ascii')} {rank}\n" for token, rank in by_rank]
    Path(path).write_text("".join(lines), encoding="ascii")


def _parse_rank_line(line: bytes) -> tuple[bytes, int] | None:
    fields = line.split()
    if len(fields) != 2:
        return None
    try:
        return base64.b64decode(fields[0], validate=True), int(fields[1])
    except ValueError:  # binascii.Error is a ValueError
        return None
