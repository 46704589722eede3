"""k3-tiny-niah retrieves, so these scores fail on a real pipeline bug (a needle at the wrong depth,
a lost cache page, a wrong KDA snapshot): niah exact match over 3 depths x 10 samples per length,
seed 0, through the in-process engine; a prefix-cache hit, a cold cache, chunked prefill that splits
the haystack and n-gram speculative decoding all give the plain run's predictions. niah_multikey_1's
bar is not reached yet (a strict xfail)."""

import pytest

from k3ray.engine import LLM
from k3ray.engine.config import SpeculativeConfig
from k3ray.evals.engine_target import EngineTarget


def test_niah_at_1k_2k_4k(plain_niah, niah_floors):
    assert all(plain_niah.scores[n] >= floor for n, floor in niah_floors.items()), plain_niah.scores


@pytest.mark.xfail(strict=True, reason="issue 21: 0.40 here, above the 0.25 of taking one of the 4 needles "
                                       "and barely a lookup by key (k3ray.evals.fixture.probe reads the asked key "
                                       "at 0.35 of 4 at best); a pass means the floor can move up")
def test_niah_multikey_1_at_2k_reaches_the_issue_s_bar(plain_niah, trained_grid, tmp_path):
    scores, _ = trained_grid(plain_niah.target, tmp_path, "niah_multikey_1", (2048,), samples=10)
    assert scores[2048] >= 0.8, scores


@pytest.mark.parametrize("variant", ["prefix_cache_hit", "cold", "chunked_prefill", "speculative"])
def test_engine_features_give_the_plain_predictions(plain_niah, trained_checkpoint, trained_grid, tmp_path, variant):
    assert plain_niah.scores[2048] >= 0.5, plain_niah.scores  # the comparison means something only if it retrieves
    want, plain = plain_niah.at(2048, samples=3), plain_niah.target
    if variant == "prefix_cache_hit":
        # these prompts again, just run: every prefill then resumes from cached blocks and snapshots
        _, again = trained_grid(plain, tmp_path / "plain", "niah", (2048,), samples=3)
        assert again == want
        target = plain
        hits_before = plain.engine.get_stats().prefix_cache_hits
    else:
        options = {
            "cold": {"enable_prefix_caching": False},
            "chunked_prefill": {"max_num_batched_tokens": 384},  # splits every 2K haystack into chunks
            "speculative": {"speculative": SpeculativeConfig(method="ngram", num_speculative_tokens=4)},
        }[variant]
        target = EngineTarget(LLM(trained_checkpoint, **{**plain_niah.engine_options, **options}))
    _, got = trained_grid(target, tmp_path / variant, "niah", (2048,), samples=3)
    assert got == want
    if variant == "prefix_cache_hit":
        assert plain.engine.get_stats().prefix_cache_hits > hits_before
