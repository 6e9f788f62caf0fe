"""The data position: prompts used up when their group settles, so a crash or Ctrl-C neither
skips the prompts in flight nor repeats the finished ones (issue 19, defect 8)."""
from __future__ import annotations

from tandem.rollout.data_position import DataPosition


def test_a_restart_issues_exactly_the_prompts_nobody_finished(tmp_path):
    path = tmp_path / "rollout-0.json"
    data = DataPosition(path)
    issued = [data.issue() for _ in range(5)]          # five groups in flight
    assert issued == [0, 1, 2, 3, 4]
    data.settle(1)
    data.settle(3)
    assert data.position == 0                          # 0 is still running
    # The worker dies with 0, 2 and 4 in flight.
    again = DataPosition(path)
    assert [again.issue() for _ in range(4)] == [0, 2, 4, 5]   # 1 and 3 are done; nothing skipped


def test_settling_in_order_moves_the_position_and_forgets_what_it_passed(tmp_path):
    data = DataPosition(tmp_path / "p.json")
    for _ in range(3):
        data.issue()
    data.settle(2)
    data.settle(0)
    assert (data.position, data.settled_ahead) == (1, {2})
    data.settle(1)
    assert (data.position, data.settled_ahead) == (3, set())


def test_a_failed_group_gives_its_prompt_back_until_its_attempts_run_out(tmp_path):
    data = DataPosition(tmp_path / "p.json", max_attempts=2)
    first = data.issue()
    data.settle(first, failed=True)                   # e.g. the reward service was restarting
    assert data.issue() == first                       # tried again before any fresh prompt
    data.settle(first, failed=True)                    # second failure: given up, and counted
    assert data.skipped == 1 and data.position == 1
    assert data.issue() == 1


def test_an_old_position_file_still_resumes(tmp_path):
    path = tmp_path / "p.json"
    path.write_text('{"position": 7}')
    assert DataPosition(path).issue() == 7
