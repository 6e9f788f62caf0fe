"""What the verdict cache keeps (reward/verdict_cache.py): the key covers everything a verdict
depends on, the least recently used entry goes first, and an error verdict or a cancelled
grading is forgotten so the next identical item is graded again."""
from __future__ import annotations

import asyncio

from tandem.reward.verdict_cache import VerdictCache, item_key
from tandem.services.protocol import GradeItem, Verdict

CODE = GradeItem(task="code", response="print(1)", tests={"inputs": ["\n"], "outputs": ["1"]})


def test_the_key_covers_response_reference_question_and_tests():
    keys = {item_key(CODE),
            item_key(GradeItem(task="code", response="print(2)", tests=CODE.tests)),
            item_key(GradeItem(task="code", response="print(1)", tests={"inputs": ["\n"], "outputs": ["2"]})),
            item_key(GradeItem(task="math", response=r"\boxed{1}", answer="1")),
            item_key(GradeItem(task="math", response=r"\boxed{1}", answer="1", question="What percent?"))}
    assert len(keys) == 5
    assert item_key(GradeItem(task="code", response="print(1)", tests={"inputs": ["\n"], "outputs": ["1"]})) \
        == item_key(CODE)


def test_least_recently_used_goes_first_and_errors_are_forgotten():
    async def main():
        loop = asyncio.get_running_loop()
        cache: VerdictCache[str] = VerdictCache(2)
        futures = {k: loop.create_future() for k in "abcd"}
        cache.put(b"a", "job a", futures["a"])
        cache.put(b"b", "job b", futures["b"])
        assert cache.get(b"a") == "job a"           # a is now the most recent
        cache.put(b"c", "job c", futures["c"])
        assert cache.get(b"b") is None and len(cache) == 2
        futures["a"].set_result(Verdict(1.0, True, {}))
        futures["c"].set_result(Verdict(-1.0, False, {"error": "grader hung"}))
        await asyncio.sleep(0)                       # done callbacks run: c is forgotten
        assert len(cache) == 1
        cache.put(b"d", "job d", futures["d"])       # room for d without evicting a
        futures["d"].cancel()
        await asyncio.sleep(0)
        return cache

    cache = asyncio.run(main())
    assert cache.get(b"a") == "job a"               # a verdict of the program: kept
    assert cache.get(b"c") is None and cache.get(b"d") is None and len(cache) == 1


def test_size_zero_keeps_nothing():
    async def main():
        cache: VerdictCache[str] = VerdictCache(0)
        cache.put(b"a", "job a", asyncio.get_running_loop().create_future())
        return cache
    assert asyncio.run(main()).get(b"a") is None


def test_the_row_is_part_of_the_key_only_where_a_user_function_reads_it():
    a = GradeItem(task="math", response=r"\boxed{1}", answer="1", row={"id": "a"})
    b = GradeItem(task="math", response=r"\boxed{1}", answer="1", row={"id": "b"})
    assert item_key(a) == item_key(b)                    # the built-in graders: one verdict for both
    assert item_key(a, with_row=True) != item_key(b, with_row=True)
