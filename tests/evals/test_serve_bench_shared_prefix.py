"""`k3ray bench serve --workload shared-prefix`: its conversations and its flags (the whole run, three
Serve apps, is what the README's figures come from)."""

from k3ray.cli import build_parser
from k3ray.evals.serve_bench.shared_prefix import conversations


def test_each_turn_extends_the_one_before_and_conversations_share_nothing():
    convs = conversations(3, 4, first_len=40, turn_len=10, output_len=2, token_range=(5, 300), seed=1)
    assert [len(c) for c in convs] == [4, 4, 4]
    for turns in convs:
        lengths = [r.prompt_len for r in turns]
        assert lengths == [40, 52, 64, 76] and all(r.output_len == 2 for r in turns)
        for before, after in zip(turns, turns[1:]):
            assert after.prompt_ids[: before.prompt_len] == before.prompt_ids
        assert all(5 <= t < 300 for t in turns[-1].prompt_ids)
    firsts = [c[0].prompt_ids[:16] for c in convs]
    assert len(set(firsts)) == 3  # no shared prefix across conversations
    again = conversations(3, 4, first_len=40, turn_len=10, output_len=2, token_range=(5, 300), seed=1)
    assert again == convs


def test_the_workload_flags():
    args = build_parser(["bench", "serve"]).parse_args(
        ["bench", "serve", "--workload", "shared-prefix", "--conversations", "4", "--turns", "3", "--turn-len", "32",
         "--start-gap-s", "0"])
    assert (args.workload, args.conversations, args.turns, args.turn_len, args.start_gap_s) == \
        ("shared-prefix", 4, 3, 32, 0.0)
