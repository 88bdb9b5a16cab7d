import torch

from dspark.runtime.kernels.accept import greedy_accept


def test_prefix_stops_at_first_mismatch_even_if_later_drafts_match() -> None:
    drafts = torch.tensor([[5, 6, 9, 8]])
    target = torch.tensor([[5, 6, 7, 8, 4]])  # draft 2 mismatches; draft 3 matches by chance
    acc = greedy_accept(drafts, target, torch.tensor([5]))
    assert acc.correct_len.tolist() == [2]
    assert acc.commit_len.tolist() == [3]
    assert acc.bonus.tolist() == [7]  # the target's token after the accepted prefix


def test_all_accepted_gives_bonus_from_last_row() -> None:
    drafts = torch.tensor([[1, 2, 3]])
    acc = greedy_accept(drafts, torch.tensor([[1, 2, 3, 9]]), torch.tensor([4]))
    assert acc.correct_len.tolist() == [3]
    assert acc.bonus.tolist() == [9]


def test_verify_len_caps_acceptance_per_request() -> None:
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    target = torch.tensor([[1, 2, 3, 4]] * 3)
    acc = greedy_accept(drafts, target, torch.tensor([2, 1, 4]))
    assert acc.correct_len.tolist() == [1, 0, 3]
    assert acc.commit_len.tolist() == [2, 1, 4]
    assert acc.bonus.tolist() == [2, 1, 4]


def test_first_draft_rejected_commits_only_the_fallback() -> None:
    acc = greedy_accept(torch.tensor([[3, 3]]), torch.tensor([[4, 3, 3]]), torch.tensor([3]))
    assert acc.correct_len.tolist() == [0]
    assert acc.bonus.tolist() == [4]


def test_new_seq_lens_advance_by_commit_len_and_keep_their_dtype() -> None:
    drafts = torch.tensor([[5, 6], [5, 0]])
    target = torch.tensor([[5, 6, 7], [5, 6, 7]])
    acc = greedy_accept(drafts, target, torch.tensor([3, 3]), torch.tensor([10, 20], dtype=torch.int32))
    assert acc.new_seq_lens is not None and acc.new_seq_lens.dtype == torch.int32
    assert acc.new_seq_lens.tolist() == [13, 22]
