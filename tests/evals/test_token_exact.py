"""Prompts have exactly the requested number of tokens, for byte and BPE tokenizers, up to 1M."""

import pytest

from k3ray.evals.fit import fit_to_length
from k3ray.evals.haystack import load_corpus
from k3ray.evals.oracle import OracleTarget
from k3ray.evals.scoring import score
from k3ray.evals.tasks import TASKS, Cell

TEXT_TASKS = [name for name, t in TASKS.items() if t.unit == "tokens"]


class _HFTokenizer:
    """encode/decode over a `tokenizers.Tokenizer` (a test-only oracle dependency)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode(self, text):
        return self.tokenizer.encode(text).ids

    def decode(self, ids):
        return self.tokenizer.decode(ids)


class _CountingTarget(OracleTarget):
    calls = 0

    def tokenize(self, text):
        self.calls += 1
        return super().tokenize(text)


@pytest.fixture(scope="module")
def bpe_target():
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    text = load_corpus()
    tok.train_from_iterator([text[i : i + 2000] for i in range(0, 100_000, 2000)], trainer)
    return _CountingTarget(tokenizer=_HFTokenizer(tok), name="bpe-oracle")


@pytest.mark.parametrize("name", TEXT_TASKS)
@pytest.mark.parametrize("length", [3000, 20_000])
def test_bpe_prompts_are_token_exact(bpe_target, name, length):
    depth = 50.0 if TASKS[name].uses_depth else None
    item = TASKS[name].build(Cell(name, length, depth), bpe_target, 0)
    assert len(bpe_target.tokenize(item.prompt)) == length == item.prompt_tokens
    assert score(bpe_target.complete(item.prompt, item.max_tokens), item.answers, item.metric) == 1.0


def test_few_tokenize_calls_per_prompt(bpe_target):
    bpe_target.calls = 0
    TASKS["niah"].build(Cell("niah", 20_000, 30.0), bpe_target, 0)
    # one count of the bare template, a guess, a secant step, then a few corrections: not a linear scan
    assert bpe_target.calls <= 10


def test_million_token_prompt_is_exact():
    target = OracleTarget()
    item = TASKS["niah"].build(Cell("niah", 1 << 20, 50.0), target, 0)
    assert len(target.tokenize(item.prompt)) == 1 << 20
    assert score(target.complete(item.prompt, item.max_tokens), item.answers, item.metric) == 1.0


def test_reserve_generation_leaves_room_for_the_answer():
    item = TASKS["vt"].build(Cell("vt", 2000, 50.0), OracleTarget(), 0, reserve_generation=True)
    assert item.prompt_tokens == 2000 - item.max_tokens == len(OracleTarget().tokenize(item.prompt))


def test_fit_finds_exact_length_under_a_non_linear_count():
    def count(s):  # about one token per 3.3 characters, rounding up per 10-character run
        return len(s) * 3 // 10 + (len(s) % 10 > 0)

    prompt, n = fit_to_length(lambda n: "x" * (n + 40), count, 1000)
    assert count(prompt) == 1000 and prompt == "x" * (n + 40)


def test_fit_steps_past_a_jump_of_two():
    def count(s):  # like BPE: the 500th character splits a token in two, the 501st merges them back
        return len(s) + (len(s) == 500) - (len(s) > 500)

    prompt, _ = fit_to_length(lambda n: "y" * n, count, 500)
    assert count(prompt) == 500
    with pytest.raises(ValueError, match="exactly"):
        fit_to_length(lambda n: "y" * (2 * n), len, 501)


def test_fit_refuses_a_length_below_the_template():
    with pytest.raises(ValueError, match="below the 30 tokens"):
        fit_to_length(lambda n: "z" * (30 + n), len, 20)
