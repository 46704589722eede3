"""Strict JSON from a JSON schema: the grammar may only write RFC 8259 text, in which a string's
quote, backslash and control characters (U+0000-U+001F) appear escaped, never raw.

xgrammar writes a schema's `pattern` as a regex over the string's raw JSON text, so a quote,
backslash or control character the pattern asks for comes out unescaped: a broken string, or one
`json.loads` rejects. So each pattern is swapped for a placeholder before xgrammar converts the
schema (`schema_with_placeholders`), and `splice` puts back the pattern written here as EBNF over
the JSON text (`pattern_ebnf`: each character set becomes its characters that may stand raw plus
the JSON escapes of the rest). Patterns are read with Python's `re` syntax, which is what
`jsonschema` validates with; a character class means what both Python and ECMA-262 agree it means.
engine/structured/structured_output.py builds every grammar through here; pure Python (no xgrammar, no torch), so
the cheap checks run wherever a request is validated (SamplingParams.validate).
"""

from __future__ import annotations

import functools
import json
import re
from re import _constants as sre
from re import _parser

Ranges = list[tuple[int, int]]  # sorted, disjoint, inclusive code point ranges

UNICODE: Ranges = [(0, 0xD7FF), (0xE000, 0x10FFFF)]  # surrogates never stand in UTF-8 text
ESCAPED: Ranges = [(0, 0x1F), (0x22, 0x22), (0x5C, 0x5C)]  # what a JSON string must escape
SHORT_ESCAPES = {0x22: '\\"', 0x5C: "\\\\", 0x08: "b", 0x0C: "f", 0x0A: "n", 0x0D: "r", 0x09: "t"}  # EBNF class text
ECMA_SPACE: Ranges = [(0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
                      (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF)]
CATEGORIES = {  # category -> (Python's one-character regex, ECMA-262's set), and whether it is negated
    sre.CATEGORY_DIGIT: (r"\d", [(0x30, 0x39)], False),
    sre.CATEGORY_NOT_DIGIT: (r"\d", [(0x30, 0x39)], True),
    sre.CATEGORY_WORD: (r"\w", [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)], False),
    sre.CATEGORY_NOT_WORD: (r"\w", [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)], True),
    sre.CATEGORY_SPACE: (r"\s", ECMA_SPACE, False),
    sre.CATEGORY_NOT_SPACE: (r"\s", ECMA_SPACE, True),
}
LINE_TERMINATORS: Ranges = [(0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029)]  # what `.` skips (ECMA; Python: \n)
FIELD = "structured_outputs.json"  # what errors name
PLACEHOLDER = "^k3raypattern{}$"
PLACEHOLDER_IN_EBNF = re.compile(r'Regex\("\^k3raypattern(\d+)\$"(?:, json_string=true)?\)')
HEX_ESCAPE = re.compile(r"\\(\\|x([0-9a-fA-F]{2}))")  # an escaped backslash, or xgrammar's \xHH
XGRAMMAR_BOUNDED_CHAR = r'[^\"\\\r\n]'  # xgrammar's character of a string with minLength / maxLength
STRICT_BOUNDED_CHAR = r'[^\0-\x1f\"\\]'
LITERAL_OR_CLASS = re.compile(r'"(?:\\.|[^"\\])*"|\[(\^?)((?:\\.|[^\]\\])*)\]')  # EBNF "..." or [...]
NOT_SCHEMAS = frozenset({"enum", "const", "default", "examples", "required", "dependentRequired"})
SCHEMA_MAPS = frozenset({"properties", "$defs", "definitions", "dependentSchemas"})


def checked_schema(text: str, max_bytes: int | None = None, field: str = FIELD) -> object:
    """The schema of structured_outputs.json (its JSON text), after the checks that need no grammar
    engine: its size, that it is JSON, and that every pattern can be enforced. Raises ValueError
    naming `field` (another schema's, such as a tool's parameters)."""
    try:
        return _checked_schema(text, max_bytes)
    except ValueError as e:
        raise renamed(e, field) from None


def renamed(e: ValueError, field: str) -> ValueError:
    """e about structured_outputs.json (the field this module's errors name) as one about `field`."""
    message = str(e)
    return ValueError(field + message[len(FIELD):] if message.startswith(FIELD) else message)


def _checked_schema(text: str, max_bytes: int | None) -> object:
    size = len(text.encode())
    if max_bytes is not None and size > max_bytes:
        raise ValueError(f"structured_outputs.json is {size} bytes, more than the limit of {max_bytes} "
                         "(max_schema_bytes)")
    try:
        schema = json.loads(text)
        patterns = schema_with_placeholders(schema)[1]
    except json.JSONDecodeError as e:
        raise ValueError(f"structured_outputs.json is not a usable JSON schema: not JSON ({e})") from None
    except RecursionError:
        raise ValueError("structured_outputs.json is not a usable JSON schema: it nests too deeply") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"structured_outputs.json is not a usable JSON schema: a schema is an object or a "
                         f"boolean, got {type(schema).__name__}")
    for pattern in patterns:
        pattern_ebnf(pattern)
    return schema


def schema_with_placeholders(schema: object) -> tuple[object, list[str]]:
    """(schema with each `pattern` and `patternProperties` key swapped for PLACEHOLDER.format(i),
    the patterns in order); a string with a pattern and length bounds the pattern does not imply
    is refused (xgrammar would drop the bounds)."""
    patterns: list[str] = []

    def placeholder(pattern: str) -> str:
        patterns.append(pattern)
        return PLACEHOLDER.format(len(patterns) - 1)

    def walk(node: object) -> object:
        if isinstance(node, list):
            return [walk(item) for item in node]
        if not isinstance(node, dict):
            return node
        out = {}
        for key, value in node.items():
            if key == "pattern" and isinstance(value, str):
                _check_bounds(value, node)
                out[key] = placeholder(value)
            elif key == "patternProperties" and isinstance(value, dict):
                out[key] = {placeholder(k): walk(v) for k, v in value.items()}
            elif key in SCHEMA_MAPS and isinstance(value, dict):
                out[key] = {k: walk(v) for k, v in value.items()}
            elif key in NOT_SCHEMAS:
                out[key] = value
            else:
                out[key] = walk(value)
        return out

    return walk(schema), patterns


def splice(ebnf: str, patterns: list[str]) -> str:
    """xgrammar's EBNF of a schema_with_placeholders schema -> the strict grammar: each placeholder
    replaced by its pattern's EBNF, bounded-length strings kept from control characters and negated
    classes from surrogates. xgrammar prints U+0080-U+00FF as \\xHH, which its parser reads on
    into the hex digits after it ("\\xe9a" is U+0E9A, not "éa"): those become \\u00HH."""
    def pattern(match: re.Match) -> str:
        return f"({pattern_ebnf(patterns[int(match.group(1))])})"

    def escape(match: re.Match) -> str:
        return match.group(0) if match.group(2) is None else f"\\u00{match.group(2)}"

    out = HEX_ESCAPE.sub(escape, ebnf)
    out = PLACEHOLDER_IN_EBNF.sub(pattern, out).replace(XGRAMMAR_BOUNDED_CHAR, STRICT_BOUNDED_CHAR)
    assert 'Regex("^k3raypattern' not in out, "xgrammar printed a pattern placeholder in an unknown form"
    return LITERAL_OR_CLASS.sub(_without_surrogates, out)


def _without_surrogates(match: re.Match) -> str:
    """A negated class leaves the surrogates out too: xgrammar's complement takes them in, as bytes
    (ED A0-BF ..) that are no UTF-8. String literals and plain classes stay as they are."""
    if match.group(1) != "^":
        return match.group(0)
    return f"[^{match.group(2)}\\ud800-\\udfff]"


# patterns -----------------------------------------------------------------------------------------
def pattern_ebnf(pattern: str) -> str:
    """An EBNF expression for the JSON text (between the quotes) of the strings that match
    `pattern` whole; anchors are allowed only where they are implied (at its start and end)."""
    try:
        tree = _parser.parse(pattern)
        return _sequence(list(tree), tree.state.flags, True, True)
    except (re.error, OverflowError) as e:
        raise ValueError(f"structured_outputs.json: pattern {pattern!r} is not a regular expression: {e}") from None
    except RecursionError:
        raise ValueError(f"structured_outputs.json: pattern {pattern!r} nests too deeply") from None
    except _Unsupported as e:
        raise ValueError(f"structured_outputs.json: pattern {pattern!r} {e}") from None


class _Unsupported(Exception):
    pass


def _check_bounds(pattern: str, schema: dict) -> None:
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (low, high or 0)) or (low, high) == (0, None):
        return  # no bounds, or bounds xgrammar refuses
    try:
        width_low, width_high = _parser.parse(pattern).getwidth()
    except (re.error, OverflowError, RecursionError):
        return  # reported by pattern_ebnf
    if width_low < low or (high is not None and width_high > high):
        raise ValueError(
            f"structured_outputs.json: a string with pattern {pattern!r} cannot also have minLength / maxLength "
            "the pattern does not imply (the grammar engine would drop them); put the length in the pattern"
        )


def _sequence(items: list, flags: int, at_start: bool, at_end: bool) -> str:
    if flags & (re.IGNORECASE | re.LOCALE):
        raise _Unsupported("uses case-insensitive or locale matching, which a grammar cannot enforce")
    parts: list[str] = []
    plain = ""  # a run of characters that stand for themselves, written as one string
    for i, (op, av) in enumerate(items):
        first, last = at_start and i == 0, at_end and i == len(items) - 1
        if op is sre.LITERAL and 0x20 <= av < 0x7F and av not in (0x22, 0x5C):
            plain += chr(av)
            continue
        if plain:
            parts.append(f'"{plain}"')
            plain = ""
        if op is sre.AT:
            if not ((first and av in (sre.AT_BEGINNING, sre.AT_BEGINNING_STRING))
                    or (last and av in (sre.AT_END, sre.AT_END_STRING))):
                raise _Unsupported("has an anchor or word boundary other than ^ / \\A at its start or $ / \\Z at its "
                                   "end, which a grammar cannot enforce")
            continue
        parts.append(_item(op, av, flags, first, last))
    if plain:
        parts.append(f'"{plain}"')
    return " ".join(parts) or '""'


def _item(op, av, flags: int, first: bool, last: bool) -> str:
    if op is sre.LITERAL:
        return _set_ebnf([(av, av)])
    if op is sre.NOT_LITERAL:
        return _set_ebnf(_subtract(UNICODE, [(av, av)]))
    if op is sre.ANY:
        return _set_ebnf(UNICODE if flags & re.DOTALL else _subtract(UNICODE, LINE_TERMINATORS))
    if op is sre.IN:
        return _set_ebnf(_class(av, flags))
    if op is sre.BRANCH:
        return "(" + " | ".join(_sequence(list(alt), flags, first, last) for alt in av[1]) + ")"
    if op is sre.SUBPATTERN:
        _, add, remove, body = av
        return f"({_sequence(list(body), (flags | add) & ~remove, first, last)})"
    if op in (sre.MAX_REPEAT, sre.MIN_REPEAT):
        low, high, body = av
        inner = f"({_sequence(list(body), flags, False, False)})"
        if high is sre.MAXREPEAT:
            return inner + {0: "*", 1: "+"}.get(low, f"{{{low},}}")
        return inner + ("?" if (low, high) == (0, 1) else f"{{{low},{high}}}")
    raise _Unsupported(f"uses {str(op).lower()} (a backreference, lookaround, possessive or atomic group), which a "
                       "grammar cannot enforce")


def _class(items: list, flags: int) -> Ranges:
    """A [...] class's code points. A negated class leaves out what either Python or ECMA-262 puts
    in its categories, a plain one takes only what both do: every choice then matches in both."""
    negate = bool(items) and items[0][0] is sre.NEGATE
    sets = []
    for op, av in items[negate:]:
        if op is sre.LITERAL:
            sets.append([(av, av)])
        elif op is sre.RANGE:
            sets.append([av])
        elif op is sre.CATEGORY:
            sets.append(_category(av, flags, wide=negate))
        else:
            raise _Unsupported(f"uses {str(op).lower()} in a character class, which a grammar cannot enforce")
    members = functools.reduce(_union, sets, [])
    return _subtract(UNICODE, members) if negate else members


def _category(category, flags: int, wide: bool) -> Ranges:
    regex, ecma, negated = CATEGORIES[category]
    python = _python_classes(bool(flags & re.ASCII))[regex]
    if negated:  # the narrow complement leaves out the wide set
        return _subtract(UNICODE, _intersect(python, ecma) if wide else _union(python, ecma))
    return _union(python, ecma) if wide else _intersect(python, ecma)


@functools.cache
def _python_classes(ascii_only: bool) -> dict[str, Ranges]:
    """Each one-character class of CATEGORIES (\\d, \\w, \\s) -> the code points Python's `re` matches with it."""
    out: dict[str, Ranges] = {}
    for regex in {regex for regex, _, _ in CATEGORIES.values()}:
        out[regex] = []
        for low, high in UNICODE:
            text = "".join(map(chr, range(low, high + 1)))
            for match in re.finditer(f"(?:{regex})+", text, re.ASCII if ascii_only else 0):
                out[regex].append((low + match.start(), low + match.end() - 1))
    return out


def _set_ebnf(ranges: Ranges) -> str:
    """The JSON text of one character of the set: a raw character, or the escape of one that may
    not stand raw (JSON's short escapes where it has one, else \\u00XX)."""
    ranges = _intersect(ranges, UNICODE)
    if not ranges:
        raise _Unsupported("has a character class that matches nothing")
    choices = []
    raw = _subtract(ranges, ESCAPED)
    if raw:
        choices.append("[" + "".join(_class_range(low, high) for low, high in raw) + "]")
    escaped = [c for low, high in _intersect(ranges, ESCAPED) for c in range(low, high + 1)]
    short = "".join(SHORT_ESCAPES[c] for c in escaped if c in SHORT_ESCAPES)
    if short:
        choices.append(f'"\\\\" [{short}]')
    for high_digit in (0, 1):
        low_digits = "".join(f"{c & 0xF:x}" for c in escaped if c not in SHORT_ESCAPES and c >> 4 == high_digit)
        if low_digits:
            choices.append(f'"\\\\u00{high_digit}" [{low_digits}]')
    return choices[0] if len(choices) == 1 else "(" + " | ".join(choices) + ")"


def _class_range(low: int, high: int) -> str:
    def code(c: int) -> str:
        return f"\\u{c:04x}" if c <= 0xFFFF else f"\\U{c:08x}"

    return code(low) if low == high else f"{code(low)}-{code(high)}"


# code point sets ----------------------------------------------------------------------------------
def _union(a: Ranges, b: Ranges) -> Ranges:
    out: Ranges = []
    for low, high in sorted(a + b):
        if out and low <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], high))
        else:
            out.append((low, high))
    return out


def _intersect(a: Ranges, b: Ranges) -> Ranges:
    out: Ranges = []
    i = j = 0
    while i < len(a) and j < len(b):
        low, high = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if low <= high:
            out.append((low, high))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _subtract(a: Ranges, b: Ranges) -> Ranges:
    complement: Ranges = []
    start = 0
    for low, high in _union(b, []):
        if low > start:
            complement.append((start, low - 1))
        start = high + 1
    if start <= 0x10FFFF:
        complement.append((start, 0x10FFFF))
    return _intersect(_union(a, []), complement)
