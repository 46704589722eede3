"""The aged-needle probe: needle prompts read from KDA states that a haystack aged first."""

import json

import pytest
import torch

from k3ray.tokenizer import ByteTokenizer
from k3ray_training.aged_needle import main, read_needle
from k3ray_training.init_weights import trained_niah_model
from k3ray_training.needle_attention import needle_prompt
from k3ray_training.state_bank import Chain, kda_layers


def test_the_shipped_model_reads_needles_fresh_and_after_a_short_haystack(tmp_path, capsys):
    out = tmp_path / "aged.json"
    main(["--ages", "0,8k", "--length", "2k", "--seeds", "0", "--threads", "1", "--json", str(out)])
    report = json.loads(out.read_text())
    assert [a["age"] for a in report["ages"]] == [0, 8192]
    fresh, aged = report["ages"]
    assert fresh["exact"] == aged["exact"] == 3, capsys.readouterr().out
    assert fresh["state_norms"] == {} and all(v > 0 for v in aged["state_norms"].values())
    assert all(r["read"] == r["answer"] and r["digits_right"] == 7 for r in aged["readings"])


def test_the_reading_depends_on_the_carried_states():
    model = trained_niah_model("k3-tiny-niah")
    tokenizer = ByteTokenizer(model.config.vocab_size)
    prompt = needle_prompt(1024, 50.0, 0, None)
    assert read_needle(model, tokenizer, prompt, None, 50.0, 0).digits_right == 7
    gen = torch.Generator().manual_seed(0)
    noise = Chain({a.layer_idx: 50 * torch.randn(a.num_heads, a.head_dim, a.head_dim, generator=gen)
                   for a in kda_layers(model)}, age=0)
    assert read_needle(model, tokenizer, prompt, noise, 50.0, 0).digits_right < 7


@pytest.mark.parametrize("argv, message", [(["--ages", "1000"], "multiples of 8192"),
                                            (["--depths", "150"], "--depths"), (["--ages", "1x"], "--lengths")])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err
