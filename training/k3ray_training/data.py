"""Training items in exactly the eval prompts' formats: each is built by the eval task's own
generator (`layout` + `fit_to_length`) from a training seed, and its answer is what the task's
perfect reader gives, so the model learns the completions that `k3ray eval` scores.

An item is (prompt ids, answer ids): the answer is " " + the reader's answer + EOS.
"""

from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass

from k3ray.evals import words
from k3ray.evals.fit import fit_to_length
from k3ray.evals.tasks import READERS, get_task
from k3ray.evals.tasks.base import Cell
from k3ray.evals.tasks.niah import QUESTION_START, needle, question
from k3ray.tokenizer import ByteTokenizer

# task -> share of training items: the needle tasks the CI thresholds cover carry most weight
TASK_MIX = {
    "niah": 0.28,
    "niah_single_1": 0.07,
    "niah_single_3": 0.05,
    "niah_multikey_1": 0.22,
    "niah_multikey_2": 0.07,
    "niah_multikey_3": 0.04,
    "niah_multivalue": 0.05,
    "niah_multiquery": 0.05,
    "vt": 0.09,
    "cwe": 0.04,
    "fwe": 0.04,
}
# these size their word lists from the token budget, so they are built to a length, not a haystack size
LENGTH_SIZED = {"cwe": 160, "fwe": 64}  # -> bytes kept free for the answer
FALLBACK_TASK = "niah"  # for a length cwe / fwe cannot fill
# a bootstrap item, not an eval format: random digits, "|", then the same digits as the answer; its
# dense copy signal forms the attention circuit that retrieval needs (the answer loss of needle items
# alone left a 2.7M model at chance for 500 steps; copying broke through after about 200)
COPY_TASK, COPY_LENGTH = "copy", 24
# a second bootstrap: key:value pairs, then each key again with its value. Copying teaches where to
# look by position; needles among several keys (niah_multikey_*) need the lookup by content, and
# every query of an item is a labelled lookup (one query per item left recall at chance for 360 steps)
RECALL_TASK = "recall"
# ("the shipped model / weights" in the measurements below: k3-tiny-niah as of commit 77fc49c, before the
# stages that built its multikey lookup; docs/multikey-lookup.md)
# recall_wide: more pairs than KDA's recurrent state holds. The shipped model solved 2-3 pairs (0.91,
# 0.77) and failed from 4 (0.2, as niah_multikey_1's four needles), a lookup through the fixed-size
# state; only MLA's attention scales past that, so these items leave no other way
RECALL_WIDE_TASK = "recall_wide"
# recall_is: the needle's own gap, "key is: value". In "key: value" the value's first digit is 3 bytes
# after the key, within the short conv's 4, so attention can match it on conv features; in a needle it
# is 6, and the match needs KDA to carry the key to the value (the gap that needles_wide did not cross).
# Measured from the shipped weights: 500 steps of recall_is mixes, then 475 more with --copy-attention 0.1,
# left recall_is's first-digit loss at 1.35-1.55 (from 1.88) and niah_multikey_1 at 2K at 0.27-0.30 (shipped:
# 0.40). The MLA heads do read the stored values, 0.1-0.25 of the first digit's attention on the asked one
# and about 0.04 on each other (copy-attention raised head 0's share to 0.10-0.30): a weak match by key.
# Supervising only the lead digit's row (--copy-rows lead, weight 0.3, 275 steps of a niah_multikey_1-heavy
# mix) took its attention loss 2.7 -> 1.56 and left niah_multikey_1 at 0.27; the shipped weights score,
# teacher-forced over 40 items each at 1450 characters, 0.23 on niah_multikey_1 and 0.05 on recall_is
# and recall_wide. Not only the many-byte key: recall with one-letter keys (a diagnostic, 350 steps) fell
# from 0.98 at 2 pairs to 0.35 at 8, a lookup through KDA's state; 250 more with --copy-rows lead gave
# 0.98 / 0.93 / 0.50 at 2 / 4 / 8 pairs: that supervision moves the lookup into MLA's attention
RECALL_IS_TASK = "recall_is"
# the key-length curriculum's rungs below recall's word keys: "q: 4812093." then "kzt: 0731562.", so the
# lookup is learnt in MLA's attention on keys a short conv sees whole, then carried to longer keys.
# Measured from the shipped weights, mixed with recall, niah and niah_multikey_1 (--copy-rows lead, 0.3):
# 250 steps left teacher-forced exact 0.54 (letters; 1.0 to 4 pairs, 0-0.33 from 5), 0.21 (2-4 letters),
# 0.54 (words), niah_multikey_1 0.33, and 200 more at 0.65 of the mix held the lead-digit loss at 0.97 (a
# plateau: the pure one-letter run above went 1.04 -> 0.53): the rungs need a mix of their own
LETTER_KEY_TASKS = {"recall_letter": (1, 1), "recall_short": (2, 4)}  # task -> key length in letters
RECALL_PAIRS = {RECALL_TASK: (2, 8), RECALL_WIDE_TASK: (8, 16), RECALL_IS_TASK: (6, 14),
                "recall_letter": (2, 10), "recall_short": (4, 12)}  # task -> pairs
RECALL_SEPARATORS = {RECALL_TASK: ":", RECALL_WIDE_TASK: ":", RECALL_IS_TASK: " is:",
                     "recall_letter": ":", "recall_short": ":"}  # key{sep} value
# how an item asks: the key and its separator, or the key and the words that follow it in niah_multikey_1's
# question, so the key is carried over that gap as the eval needs (the bare form alone did not carry)
RECALL_LONG_QUERY = " mentioned in the text above are"
# a niah_multikey_1 item asked about each of its keys in turn, in the eval's own question form, the
# earlier answers in the prompt and labelled: one 2K-token haystack trains four lookups by key, not one
# (multikey items capped at 768 characters lifted 1K but not 2K: the lookup must be learnt at length)
CHAIN_TASK, CHAIN_BASE = "multikey_chain", "niah_multikey_1"
_NUMBER_NEEDLE = re.compile(r"One of the special magic numbers for (\S+) is: (\d+)\.")
# recall_wide's width in niah's own needle sentences, each key asked in the eval's question, no
# haystack: recall_wide lifted recall at 4-6, 8, 9, 12 and 13 pairs to 0.7-1.0 (7, 11, 14: 0.44, 0.33,
# 0.29) yet left niah_multikey_1 at 0.13, as a lookup learnt on "key: value" does not read "for key is: value".
# Measured from the shipped weights plus 600 steps of a recall_wide mix: 400 steps at 0.35 of the mix,
# then 450 at 0.6, left its first-digit loss at 1.7 (2.2 = a guess among 9 needles), teacher-forced
# exact 0.5-0.69 at 2-4 needles and 0.19-0.31 at 6-8 (16 items each): still the recurrent-state lookup.
# The key sits 6 bytes before the value, past the short conv's 4, so a next try bridges from recall's
# adjacent "key: value"
NEEDLES_WIDE_TASK, NEEDLES_WIDE_COUNT = "needles_wide", (6, 12)
BOOTSTRAP_TASKS = (COPY_TASK, RECALL_TASK, RECALL_WIDE_TASK, RECALL_IS_TASK, *LETTER_KEY_TASKS, CHAIN_TASK,
                   NEEDLES_WIDE_TASK)


@dataclass(frozen=True)
class Example:
    task: str
    prompt: list[int]
    answer: list[int]  # the completion tokens, EOS last
    references: tuple[str, ...]
    prompt_labels: tuple[int, ...] = ()  # prompt positions whose next token is trained on too


def answer_text(prompt: str) -> str:
    for read in READERS:
        found = read(prompt)
        if found is not None:
            return found
    raise AssertionError("no reader recognises a generated prompt")


def _byte_count(text: str) -> int:
    return len(text.encode("utf-8"))


def make_example(task_name: str, haystack: int, rng: random.Random, tokenizer: ByteTokenizer) -> Example:
    """One item of task_name around `haystack` characters of haystack text, at a random depth
    (cwe / fwe: a prompt of the template plus about `haystack` tokens)."""
    if task_name == COPY_TASK:
        digits = "".join(rng.choice("0123456789") for _ in range(COPY_LENGTH))
        return Example(COPY_TASK, tokenizer.encode(digits + "|"), tokenizer.encode(digits) + [tokenizer.eos_token_id],
                       (digits,))
    if task_name in RECALL_PAIRS:
        return recall_example(rng, tokenizer, task_name)
    if task_name == CHAIN_TASK:
        return chain_example(haystack, rng, tokenizer)
    if task_name == NEEDLES_WIDE_TASK:
        return needles_example(rng, tokenizer)
    task = get_task(task_name)
    if task_name in LENGTH_SIZED:
        template = 400  # the cwe / fwe instructions, in bytes
        budget = template + haystack
        layout = task.layout(rng, Cell(task_name, budget, None, 0), _byte_count, budget)
        prompt, _ = fit_to_length(layout.render, _byte_count, budget)
    else:
        layout = task.layout(rng, Cell(task_name, haystack, None, 0), _byte_count, haystack)
        prompt = layout.render(haystack)
    answer = tokenizer.encode(" " + answer_text(prompt)) + [tokenizer.eos_token_id]
    return Example(task_name, tokenizer.encode(prompt), answer, layout.answers)


def recall_example(rng: random.Random, tokenizer: ByteTokenizer, task: str = RECALL_TASK) -> Example:
    """ "brave-lantern: 4812093. calm-river: 0731562. | calm-river: 0731562. brave-lantern:" ->
    " 4812093" + EOS (the niah needles' keys and 7-digit values, without their sentence; the
    task's separator in place of ":"); every key is asked once, in shuffled order, in one of
    two forms (the separator, or RECALL_LONG_QUERY), and the earlier queries' digits are labelled in
    the prompt."""
    count = rng.randint(*RECALL_PAIRS[task])
    keys = letter_keys(rng, count, LETTER_KEY_TASKS[task]) if task in LETTER_KEY_TASKS else words.word_keys(rng, count)
    values = dict(zip(keys, words.magic_numbers(rng, len(keys))))
    sep = RECALL_SEPARATORS[task]
    ask = rng.choice((sep, RECALL_LONG_QUERY))
    prompt = tokenizer.encode(" ".join(f"{k}{sep} {v}." for k, v in values.items()) + " |")
    labels: list[int] = []
    order = rng.sample(keys, len(keys))
    for key in order[:-1]:
        prompt += tokenizer.encode(f" {key}{ask} ")
        digits = tokenizer.encode(values[key])
        labels += range(len(prompt) - 1, len(prompt) - 1 + len(digits))  # each predicts the next digit
        prompt += digits + tokenizer.encode(".")
    asked = order[-1]
    prompt += tokenizer.encode(f" {asked}{ask}")
    return Example(task, prompt, tokenizer.encode(" " + values[asked]) + [tokenizer.eos_token_id],
                   (values[asked],), tuple(labels))


def letter_keys(rng: random.Random, count: int, lengths: tuple[int, int]) -> list[str]:
    """`count` distinct keys of random lowercase letters, each lengths[0] to lengths[1] long."""
    assert count <= 26 ** lengths[0], "a one-letter key set holds at most 26"
    keys: dict[str, None] = {}
    while len(keys) < count:
        keys["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(*lengths)))] = None
    return list(keys)


def chain_example(haystack: int, rng: random.Random, tokenizer: ByteTokenizer) -> Example:
    """A niah_multikey_1 prompt cut before its question, then its needles' keys asked in turn."""
    layout = get_task(CHAIN_BASE).layout(rng, Cell(CHAIN_BASE, haystack, None, 0), _byte_count, haystack)
    prompt = layout.render(haystack)
    body = prompt[: prompt.rindex(QUESTION_START)]
    pairs = _NUMBER_NEEDLE.findall(body)
    assert len(pairs) >= 2, "a multikey haystack holds several needles"
    return _asked_in_turn(CHAIN_TASK, body, pairs, rng, tokenizer)


def needles_example(rng: random.Random, tokenizer: ByteTokenizer) -> Example:
    """6-12 needle sentences back to back, then each key asked as chain_example asks it."""
    keys = words.word_keys(rng, rng.randint(*NEEDLES_WIDE_COUNT))
    pairs = list(zip(keys, words.magic_numbers(rng, len(keys))))
    body = " ".join(needle("numbers", key, value) for key, value in pairs)
    return _asked_in_turn(NEEDLES_WIDE_TASK, body, pairs, rng, tokenizer)


def _asked_in_turn(task: str, body: str, pairs: list[tuple[str, str]], rng: random.Random,
                   tokenizer: ByteTokenizer) -> Example:
    """body, then the eval's question for each (key, value) in shuffled order: "... are 4812093."
    answered (answer tokens labelled) for all but the last, which is the item's answer."""
    order = rng.sample(pairs, len(pairs))
    ids = tokenizer.encode(body)
    labels: list[int] = []
    for key, value in order[:-1]:
        ids += tokenizer.encode(question("numbers", key))
        digits = tokenizer.encode(" " + value)
        labels += range(len(ids) - 1, len(ids) - 1 + len(digits))  # each predicts the next answer token
        ids += digits + tokenizer.encode(".")
    key, value = order[-1]
    ids += tokenizer.encode(question("numbers", key))
    return Example(task, ids, tokenizer.encode(" " + value) + [tokenizer.eos_token_id], (value,), tuple(labels))


def sample_example(haystack: int, rng: random.Random, tokenizer: ByteTokenizer,
                   mix: dict[str, float] = TASK_MIX) -> Example:
    names, shares = zip(*mix.items())
    name = rng.choices(names, shares)[0]
    try:
        return make_example(name, haystack, rng, tokenizer)
    except ValueError:  # too short for a word-count task
        return make_example(FALLBACK_TASK, haystack, rng, tokenizer)


def heldout_set(haystacks: tuple[int, ...], tasks: tuple[str, ...], per_cell: int, seed: int,
                tokenizer: ByteTokenizer) -> list[Example]:
    """A fixed evaluation set, from a seed the training stream never uses."""
    rng = random.Random(f"heldout:{seed}")
    return [make_example(t, n, rng, tokenizer) for n in haystacks for t in tasks for _ in range(per_cell)]


def step_haystack(step: int, total_steps: int, rng: random.Random, max_haystack: int) -> int:
    """The length curriculum in haystack characters: short haystacks growing to 64-768 over the
    first half (the probe's recipe, without which retrieval never starts), then mostly 128-768 with
    1.7K and 3.7K (a 2K- and a 4K-token prompt) steps, capped at max_haystack."""
    warm = 0.5 * total_steps
    if step < warm:
        f = step / warm
        size = rng.uniform(32 + 32 * f, 64 + 704 * f)
    else:
        size = rng.choices([rng.uniform(128, 768), 1700, 3700], [0.5, 0.3, 0.2])[0]
    return max(16, min(max_haystack, int(size)))
