"""The data-parallel router (engine/router.py): one test per rule of its choice."""
from engine.router import Balance, PrefixRouter, block_hashes

BLOCK = 4


def prompt(first: int, blocks: int, tail: int = 0) -> list[int]:
    """`blocks` full blocks of tokens first, first + 1, ..., then `tail` more tokens."""
    return list(range(first, first + blocks * BLOCK + tail))


def router(engines: int = 3, capacity: int = 100) -> PrefixRouter:
    return PrefixRouter([capacity] * engines, BLOCK, Balance(slack=2, ratio=1.5))


def test_block_hashes_chain_whole_blocks_only():
    a, b = block_hashes(prompt(0, 3, tail=2), BLOCK), block_hashes(prompt(0, 2) + [99] * BLOCK, BLOCK)
    assert len(a) == 3  # the partial block is not hashed
    assert a[:2] == b[:2] and a[2] != b[2]
    assert block_hashes([7] * BLOCK + prompt(0, 1), BLOCK)[1] != block_hashes(prompt(0, 1), BLOCK)[0]  # chained


def test_without_a_cached_prefix_the_least_loaded_engine_takes_it():
    r = router()
    r.started(0, prompt(100, 2))
    r.started(1, prompt(200, 2))
    assert r.choose(prompt(300, 5)) == 2
    r.started(2, prompt(300, 5))
    r.started(2, prompt(400, 5))
    assert r.choose(prompt(500, 5)) == 0  # loads 1, 1, 2: the lowest index among the least loaded


def test_the_longest_cached_prefix_wins():
    r = router()
    r.started(0, prompt(0, 2))
    r.started(1, prompt(0, 4))
    r.started(2, prompt(50, 8))
    assert r.choose(prompt(0, 4, tail=3)) == 1
    assert r.choose(prompt(0, 2) + [999] * 8) == 0  # both hold its first two blocks, load alike: the first


def test_equal_prefixes_go_to_the_less_loaded_holder():
    r = router()
    r.started(0, prompt(0, 3))
    r.started(0, prompt(900, 1))
    r.started(1, prompt(0, 3))
    assert r.choose(prompt(0, 3, tail=1)) == 1


def test_a_slightly_busier_prefix_holder_keeps_the_request():
    r = router(engines=2)
    for _ in range(2):  # two more than engine 1: not more than the slack
        r.started(0, prompt(0, 4))
    assert r.choose(prompt(0, 4, tail=2)) == 0


def test_a_markedly_busier_prefix_holder_loses_it_to_the_least_loaded():
    r = router(engines=2)
    for _ in range(3):  # three more than an idle engine 1: beyond the slack and the ratio
        r.started(0, prompt(0, 4))
    assert r.choose(prompt(0, 4, tail=2)) == 1


def test_both_slack_and_ratio_must_be_exceeded():
    r = router(engines=2)
    for _ in range(10):
        r.started(1, prompt(500, 1))
    for _ in range(14):  # 4 beyond engine 1's 10 (more than the slack) but only 1.4 times it
        r.started(0, prompt(0, 4))
    assert r.choose(prompt(0, 4, tail=2)) == 0


def test_finished_requests_no_longer_count_as_load():
    r = router(engines=2)
    for _ in range(3):
        r.started(0, prompt(0, 4))
    assert r.choose(prompt(0, 4)) == 1
    for _ in range(3):
        r.finished(0)
    assert r.choose(prompt(0, 4)) == 0  # idle again, and its cache still holds the prefix


def test_an_engine_forgets_its_least_recently_routed_blocks_beyond_its_pool():
    r = router(engines=2, capacity=4)
    r.started(0, prompt(0, 3))
    r.finished(0)
    r.started(1, prompt(0, 1))  # engine 1 holds the first block only
    r.finished(1)
    assert r.choose(prompt(0, 3)) == 0
    r.started(0, prompt(500, 3))  # 6 blocks sent to a pool of 4: the older prompt's last blocks go first
    r.finished(0)
    assert r.matched_blocks(0, block_hashes(prompt(0, 3), BLOCK)) == 1
    assert r.choose(prompt(0, 3)) == 0  # a tie on one block each, equal loads: the first
