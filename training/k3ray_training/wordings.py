"""The prompt wordings training items are written in, and their chat rendering, so a model learns
the tasks rather than one sentence.

Families by name: the eval templates ("k3ray", RULER's exact "ruler") and paraphrases written here
(other head sentences, questions, answer prefixes and, in some, needle sentences; one has no head
at all). The needle tasks take every family; vt, cwe and fwe take the eval templates only.
HELDOUT_WORDING is the family a run keeps out of training (`--heldout-wording`) to score separately.

A chat item is the same prompt as system and user messages through the tokenizer's chat template
(as the server's /v1/chat/completions applies it), answered in the assistant turn, ending with the
end-of-turn token.
"""

from __future__ import annotations

import random

from k3ray.evals.tasks.templates import (
    CWE_WORDINGS,
    FWE_WORDINGS,
    NEEDLE_TEMPLATES,
    TEMPLATES,
    VT_WORDINGS,
    NeedleTemplate,
    Wording,
)
from k3ray.tokenizer import ByteTokenizer
from k3ray.tokenizer import special as sp

PARAPHRASES = {
    "para_recall": NeedleTemplate(
        "para_recall",
        Wording("The text below hides some special magic {noun}. Read it carefully and keep them in mind.\n",
                "\nQuestion: what are the special magic {noun} for {query} in the text?",
                " Answer: the special magic {noun} for {query} are"),
        Wording("The text below hides a special magic {noun}. Read it carefully and keep it in mind.\n",
                "\nQuestion: what is the special magic {noun} for {query} in the text?",
                " Answer: the special magic {noun} for {query} is"),
    ),
    "para_find": NeedleTemplate(
        "para_find",
        Wording("Several special magic {noun} are buried in the document that follows. Find them.\n",
                "\nFind every special magic {noun} given for {query} in the document.",
                " The special magic {noun} given for {query}:"),
        Wording("One special magic {noun} is buried in the document that follows. Find it.\n",
                "\nFind the special magic {noun} given for {query} in the document.",
                " The special magic {noun} given for {query}:"),
        needle="Special magic {noun} for {key}: {value}.",
    ),
    "para_codes": NeedleTemplate(
        "para_codes",
        Wording("Hidden in the passage below are special magic {noun}, each tied to a key. Memorize every one.\n",
                "\nWhich special magic {noun} belong to {query} according to the passage above?",
                " The special magic {noun} that belong to {query} are"),
        Wording("Hidden in the passage below is a special magic {noun} tied to a key. Memorize it.\n",
                "\nWhich special magic {noun} belongs to {query} according to the passage above?",
                " The special magic {noun} that belongs to {query} is"),
        needle="Remember this: the special magic {noun} for {key} include {value}.",
        serial_comma=True,
    ),
    "para_list": NeedleTemplate(  # no head sentence: the haystack comes first
        "para_list",
        Wording("", "\n\nList the special magic {noun} for {query} that appear in the context.",
                " Special magic {noun} for {query}:"),
        Wording("", "\n\nGive the special magic {noun} for {query} that appears in the context.",
                " Special magic {noun} for {query}:"),
    ),
    "para_quiz": NeedleTemplate(
        "para_quiz",
        Wording("Pay attention to the special magic {noun} in the following passage; a question about them comes "
                "at the end.\n",
                "\nQuiz: tell me all the special magic {noun} for {query} from the passage.",
                " Reply: the special magic {noun} for {query} are"),
        Wording("Pay attention to the special magic {noun} in the following passage; a question about it comes "
                "at the end.\n",
                "\nQuiz: tell me the special magic {noun} for {query} from the passage.",
                " Reply: the special magic {noun} for {query} is"),
    ),
}
HELDOUT_WORDING = "para_quiz"
WORDINGS = (*TEMPLATES, *PARAPHRASES)
SYSTEM_PROMPTS = (
    None,  # the chat template's own default system message
    "You are a helpful assistant.",
    "You read long documents and answer questions about them. Give only the requested values.",
)


def needle_template(wording: str) -> str | NeedleTemplate:
    """What a needle task's `template` takes for a family: an eval template's name, or a paraphrase."""
    return wording if wording in TEMPLATES else PARAPHRASES[wording]


def takes(task: str, wording: str) -> bool:
    """Whether a task can be written in a family: needle tasks in all, the others in the eval templates."""
    return wording in TEMPLATES or task.startswith("niah")


def answer_prefix_at(prompt: str) -> int:
    """Where a generated prompt's answer prefix starts: the last place one of the known answer
    prefixes' fixed openings occurs (RULER's prepare scripts find it the same way)."""
    return max(prompt.rfind(opening) for opening in _PREFIX_OPENINGS)


def _opening(prefix: str) -> str:
    return prefix.split("{", 1)[0]


_PREFIX_OPENINGS = tuple(
    {_opening(w.answer_prefix) for t in (*NEEDLE_TEMPLATES.values(), *PARAPHRASES.values())
     for w in (t.plural, t.singular) if w is not None}
    | {_opening(w.answer_prefix) for table in (VT_WORDINGS, CWE_WORDINGS, FWE_WORDINGS) for w in table.values()}
)


def chat_ids(prompt: str, answer: str, rng: random.Random, tokenizer: ByteTokenizer) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids) of a text item as chat: a system message (or the template's default),
    then either the whole prompt as the user's message (answer prefix included, as a RULER file sent
    through chat is) or the prompt up to its question with the answer prefix begun in the assistant
    turn; the answer closes the turn with <|im_end|>."""
    system = rng.choice(SYSTEM_PROMPTS)
    messages = [] if system is None else [{"role": "system", "content": system}]
    cut = answer_prefix_at(prompt)
    assert cut > 0, "a generated prompt ends with a known answer prefix"
    end = [tokenizer.special_tokens[sp.IM_END]]
    if rng.random() < 0.5:
        ids = tokenizer.encode_chat(messages + [{"role": "user", "content": prompt}])
        return ids, tokenizer.encode(answer.strip()) + end
    prefix = prompt[cut:].strip()
    ids = tokenizer.encode_chat(messages + [{"role": "user", "content": prompt[:cut]},
                                            {"role": "assistant", "content": prefix}],
                                continue_final_message=True)
    return ids, tokenizer.encode(" " + answer.strip()) + end
