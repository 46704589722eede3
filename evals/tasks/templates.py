"""Prompt wordings of the text tasks, by name: "ruler" (the default: RULER's own templates and
answer prefixes, from NVIDIA/RULER scripts/data/synthetic/constants.py, so k3ray's prompts and
RULER-prepared files share their text) and "k3ray" (the project's earlier wording, kept as a variant).

A task takes `template=` a name here (or, for niah, a `NeedleTemplate`, as the training data's
paraphrases do) and asks `needle_template` / `vt_wording` / `cwe_wording` / `fwe_wording` for its
head (before the haystack) and its tail (the question, then the answer prefix the model completes).
The tasks' readers parse every named wording.
"""

from __future__ import annotations

from dataclasses import dataclass

TEMPLATES = ("k3ray", "ruler")
DEFAULT_TEMPLATE = "ruler"


def check_template(name: object) -> None:
    if name not in TEMPLATES:
        raise ValueError(f"template must be one of {TEMPLATES}, got {name!r}")


@dataclass(frozen=True)
class Wording:
    """One task prompt's fixed text: `head` + haystack + `question` + `answer_prefix`."""

    head: str
    question: str
    answer_prefix: str

    @property
    def tail(self) -> str:
        return self.question + self.answer_prefix

    def format(self, **fields: object) -> Wording:
        return Wording(self.head.format(**fields), self.question.format(**fields), self.answer_prefix.format(**fields))


@dataclass(frozen=True)
class NeedleTemplate:
    """A needle wording: format fields {noun} (plural, "numbers") and {query} (the asked keys);
    `singular` (None: the plural serves) is used for one asked key with one value, with the noun's
    singular ("number"), as RULER does; `needle` has {noun}, {key}, {value}."""

    name: str
    plural: Wording
    singular: Wording | None = None
    needle: str = "One of the special magic {noun} for {key} is: {value}."
    serial_comma: bool = False  # "a, b, and c" (RULER) or "a, b and c"

    def wording(self, noun: str, keys: list[str], values_asked: int) -> Wording:
        """The formatted head, question and answer prefix for `keys` asked, `values_asked` values in all."""
        query = join_keys(keys, self.serial_comma)
        if values_asked == 1 and self.singular is not None:
            return self.singular.format(noun=noun.removesuffix("s"), query=query)
        return self.plural.format(noun=noun, query=query)


def join_keys(keys: list[str], serial_comma: bool = False) -> str:
    if len(keys) == 1:
        return keys[0]
    return ", ".join(keys[:-1]) + (", and " if serial_comma else " and ") + keys[-1]


def ruler_singular(plural: Wording) -> Wording:
    """RULER niah.py's rewrite of its template for one needle and one value, on the unformatted text."""

    def rewrite(text: str) -> str:
        return (text.replace("Some", "A").replace("are all", "is").replace("are", "is")
                .replace("answers", "answer"))

    return Wording(rewrite(plural.head), rewrite(plural.question), rewrite(plural.answer_prefix))


_RULER_NIAH = Wording(
    "Some special magic {noun} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {noun} afterwards.\n",
    "\nWhat are all the special magic {noun} for {query} mentioned in the provided text?",
    " The special magic {noun} for {query} mentioned in the provided text are",
)
NEEDLE_TEMPLATES = {
    "k3ray": NeedleTemplate("k3ray", Wording(
        "Some special magic {noun} are hidden inside the following text. "
        "Remember them: you will be asked about them afterwards.\n",
        "\nWhat are all the special magic {noun} for {query} mentioned in the text above?",
        " The special magic {noun} for {query} mentioned in the text above are",
    )),
    "ruler": NeedleTemplate("ruler", _RULER_NIAH, ruler_singular(_RULER_NIAH), serial_comma=True),
}


def needle_template(template: str | NeedleTemplate) -> NeedleTemplate:
    if isinstance(template, NeedleTemplate):
        return template
    check_template(template)
    return NEEDLE_TEMPLATES[template]


VT_WORDINGS = {
    "k3ray": Wording(
        "Track the chains of variable assignments hidden in the following text.\n\n",
        "\nQuestion: Which variables are assigned the value {value} in the text above?",
        " Answer: The variables assigned the value {value} in the text above are:",
    ),
    "ruler": Wording(
        "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n",
        "\nQuestion: Find all variables that are assigned the value {value} in the text above.",
        " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
        "assigned the value {value}, they are: ",
    ),
}
CWE_WORDINGS = {
    "k3ray": Wording(
        "Below is a numbered list of words. Some words appear more often than others: remember which.\n",
        "\nQuestion: What are the {num} most common words in the list above?",
        " Answer: The {num} most common words in the list above are:",
    ),
    "ruler": Wording(
        "Below is a numbered list of words. In these words, some appear more often than others. "
        "Memorize the ones that appear most often.\n",
        "\nQuestion: What are the {num} most common words in the above list?",
        " Answer: The top {num} words that appear most often in the list are:",
    ),
}
# how the numbered list's items are separated: k3ray one a line, RULER "1. apple 2. pear"
CWE_ITEM_SEPARATOR = {"k3ray": "\n", "ruler": " "}
FWE_WORDINGS = {
    "k3ray": Wording(
        "Read the coded text below and keep count of how often each coded word occurs. Ignore the dots.\n",
        "\nQuestion: What are the {num} most frequent coded words in the text above? Do not explain.",
        " Answer: The {num} most frequent coded words in the text above are:",
    ),
    "ruler": Wording(
        "Read the following coded text and track the frequency of each coded word. Find the three most "
        "frequently appeared coded words. ",
        "\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three most "
        "frequently appeared words in the above coded text?",
        " Answer: According to the coded text above, the three most frequently appeared words are:",
    ),
}
FWE_HEADS = tuple(w.head for w in FWE_WORDINGS.values())


def vt_wording(template: str, value: str, num_vars: int) -> Wording:
    check_template(template)
    return VT_WORDINGS[template].format(value=value, num_v=num_vars)


def cwe_wording(template: str, num_common: int) -> Wording:
    check_template(template)
    if template == "ruler" and num_common != 10:
        raise ValueError(f"RULER's cwe template asks for 10 words, got num_common={num_common}")
    return CWE_WORDINGS[template].format(num=num_common)


def fwe_wording(template: str, num_answers: int) -> Wording:
    check_template(template)
    if template == "ruler" and num_answers != 3:
        raise ValueError(f"RULER's fwe template asks for three words, got num_answers={num_answers}")
    return FWE_WORDINGS[template].format(num=num_answers)
