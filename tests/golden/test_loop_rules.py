"""The engine loop's shared rules, checked against hand-computed cases."""

import pytest

from dflash_trt.errors import DFlashTrtError
from dflash_trt.reference.loop_rules import Kept, check_request, keep_tokens


def test_keep_tokens_clips_to_the_budget_left():
    assert keep_tokens([5, 6, 7, 8], 2, set()) == Kept([5, 6], False)
    assert keep_tokens([5, 6], 9, set()) == Kept([5, 6], False)


def test_keep_tokens_cuts_after_the_first_stop_token():
    assert keep_tokens([5, 2, 7, 2], 4, {2}) == Kept([5, 2], True)


def test_a_stop_beyond_the_budget_does_not_stop():
    assert keep_tokens([5, 6, 2], 2, {2}) == Kept([5, 6], False)


def test_keep_tokens_cuts_where_a_stop_word_completes():
    ends = [9, 5]
    assert keep_tokens([9, 5, 6], 3, set(), lambda new: new[-len(ends) :] == ends) == Kept([9, 5], True)


@pytest.mark.parametrize(
    ("prompt", "new", "max_seq_len", "message"),
    [
        ([], 4, None, "prompt 3 is empty"),
        ([1, 10], 4, None, r"prompt 3 has token ids outside the vocabulary \(0..9\)"),
        ([-1], 4, None, "outside the vocabulary"),
        ([1], 0, None, "max_new_tokens must be >= 1, got 0 for prompt 3"),
        ([1, 2], 7, 8, r"prompt 3: prompt \(2\) \+ max_new_tokens \(7\) exceeds max_seq_len 8"),
    ],
)
def test_check_request_refuses_in_one_line(prompt, new, max_seq_len, message):
    with pytest.raises(DFlashTrtError, match=message):
        check_request(3, prompt, new, 10, max_seq_len)


def test_check_request_accepts_what_fits_exactly():
    check_request(0, [0, 9], 6, 10, 8)
