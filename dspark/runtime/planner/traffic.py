"""The online calibration's label-free traffic checks: has what is being served changed?

Two views of the traffic, neither needing a label. `traffic_shift`: the draft's confidence logits of the most
recent request-steps against the other requests' in the window. `prompt_shift`: how surprising the newest
prompts are to the target (the mean negative log-likelihood of a prompt's last 64 tokens, which the
prefill scores: `ExtendSteps`), against the prompts before them. A change of text moves the prompts'
surprise by 1.8 to 3.1 of its own prompt-to-prompt standard deviations (against the tiny pair's held-out
standard library: other packages' code and installed distributions' descriptions in turn 1.8, the
descriptions alone 2.5, torch's C++ headers 3.1), so a few new prompts tell it; the draft's confidence moves
by half a request's deviation or less, which the same requests' steps tell only at the edge of their noise
(docs/results.md, "Online calibration under drift").
"""

from __future__ import annotations

import math

import numpy as np

# Requests each side of the traffic check needs: its standard error counts requests, not rows.
MIN_SHIFT_REQUESTS = 16
# Older rows an age group needs before the recent rows of that age are compared with them.
MIN_AGE_ROWS = 32
AGE_GROUPS_PER_DOUBLING = 4
# The newest request-steps the traffic check reads (the window may keep 65,536): its older side needs a few
# hundred requests, which these hold at any batch, and past them it cost 2.7 ms a check.
TRAFFIC_ROWS = 16384


def age_group(ages: np.ndarray) -> np.ndarray:
    """Tokens a request had generated, in groups `AGE_GROUPS_PER_DOUBLING` to each doubling (a group is a
    fifth of its age wide: a long generation's confidence drifts slowly, a short one's token by token)."""
    doublings = np.log2(np.asarray(ages, dtype=np.float64) + 1.0)
    return np.floor(AGE_GROUPS_PER_DOUBLING * doublings).astype(np.int64)


def number_requests(requests: np.ndarray) -> tuple[int, np.ndarray]:
    """How many requests `requests` (each row's id) holds, and each row's number among them from 0 in the
    order of their ids: as `np.unique(requests, return_inverse=True)` numbers them, without its sort where
    the ids span few more numbers than there are rows (a runtime hands its request ids out in order: a
    window's are a short run of numbers; sorting 16,384 of them was half a check's time)."""
    if requests.shape[0] == 0:
        return 0, np.zeros(0, dtype=np.int64)
    low, high = int(requests.min()), int(requests.max())
    if high - low >= 4 * requests.shape[0]:
        ids, number = np.unique(requests, return_inverse=True)
        return int(ids.shape[0]), number
    present = np.zeros(high - low + 1, dtype=bool)
    present[requests - low] = True
    numbers = np.cumsum(present) - 1
    return int(numbers[-1]) + 1, numbers[requests - low]


def _clustered_mean(x: np.ndarray, request: np.ndarray, weights: np.ndarray, requests: int
                    ) -> tuple[float, float, int]:
    """The weighted mean of `x`, its variance clustered by request (`request`: each row's, numbered from 0 to
    `requests`; with the small-sample factor G/(G-1)), and the number of requests G with weight."""
    total = float(weights.sum())
    if total <= 0:
        return 0.0, 0.0, 0
    mean = float((weights * x).sum()) / total
    sums = np.bincount(request, weights=weights * (x - mean), minlength=requests)
    clusters = int(np.count_nonzero(np.bincount(request, weights=weights, minlength=requests)))
    variance = float((sums ** 2).sum()) / total ** 2 * clusters / max(clusters - 1, 1)
    return mean, variance, clusters


def traffic_shift(level: np.ndarray, requests: np.ndarray, ages: np.ndarray, recent: int) -> float | None:
    """How far the last `recent` rows' mean `level` (a row's mean confidence logit over draft positions) lies
    from the older rows', in standard errors (negative: the recent traffic is harder to draft); `requests` and
    `ages` (tokens generated) are the rows' own, oldest first.

    The older side is the rows of other requests than the recent rows' (a request's own earlier rows are the
    same text a few tokens younger: in a batch decoding in lockstep they made a T 0.8 run's in-distribution
    traffic cross 5 standard errors; without them, 3), weighted to the recent rows' mix of ages (`age_group`;
    recent rows of an age the older side holds fewer than `MIN_AGE_ROWS` of are left out): a request's
    confidence moves as its generation goes on, so a batch of long generations started together would
    otherwise look like new traffic at every start. Each side's variance is clustered by request, as a
    request's rows move together; the sides share no request, so they are independent. None when the window
    holds fewer than twice `recent` rows, or either side fewer than `MIN_SHIFT_REQUESTS` requests."""
    n = level.shape[0]
    if recent < 1 or n < 2 * recent:
        return None
    new = np.arange(n) >= n - recent
    count, request = number_requests(requests)
    recent_request = np.zeros(count, dtype=bool)
    recent_request[request[new]] = True
    old = ~new & ~recent_request[request]
    group = age_group(ages)
    old_count = np.bincount(group[old], minlength=int(group.max()) + 1)
    new_weight = np.where(new, old_count[group] >= MIN_AGE_ROWS, False).astype(np.float64)
    new_count = np.bincount(group, weights=new_weight, minlength=old_count.shape[0])
    old_weight = np.where(old, new_count[group] / np.maximum(old_count[group], 1), 0.0)
    old_mean, old_var, old_clusters = _clustered_mean(level, request, old_weight, count)
    new_mean, new_var, new_clusters = _clustered_mean(level, request, new_weight, count)
    if min(old_clusters, new_clusters) < MIN_SHIFT_REQUESTS or old_var + new_var <= 0:
        return None
    return (new_mean - old_mean) / math.sqrt(old_var + new_var)


# The newest prompts `prompt_shift` compares with those before them, and how many of those it needs.
PROMPT_RECENT = 32
PROMPT_OLDER = 4 * PROMPT_RECENT
# Prompts the window keeps: the older side's mean and spread are pinned down long before this.
PROMPT_WINDOW = 4096


class PromptWindow:
    """The surprise (mean negative log-likelihood, nats a token) of the last `capacity` prompts, in order."""

    def __init__(self, capacity: int = PROMPT_WINDOW) -> None:
        self.scores = np.zeros(capacity)
        self.capacity, self.size, self.next = capacity, 0, 0

    def add(self, surprise: float) -> None:
        if not math.isfinite(surprise):
            return  # a prompt the probe could not score says nothing of the traffic
        self.scores[self.next] = surprise
        self.next = (self.next + 1) % self.capacity
        self.size = min(self.size + 1, self.capacity)

    def recent(self, n: int | None = None) -> np.ndarray:
        """A copy of the last `n` scores (all when None), oldest first."""
        n = self.size if n is None else min(n, self.size)
        return self.scores[(self.next - n + np.arange(n)) % self.capacity]

    def keep_recent(self, n: int) -> None:
        """Forget all but the last `n` prompts: after a drift the older side is the new traffic."""
        kept = self.recent(n)
        self.scores[:kept.shape[0]] = kept
        self.size, self.next = kept.shape[0], kept.shape[0] % self.capacity


def prompt_shift(surprise: np.ndarray, recent: int = PROMPT_RECENT, older: int = PROMPT_OLDER
                 ) -> float | None:
    """How far the last `recent` prompts' mean surprise lies from the prompts' before them, in standard
    errors (positive: the new prompts are harder for the target); `surprise` oldest first. None while
    fewer than `older` precede them, or where those are all alike.

    The standard error is the spread of the means of every `recent` consecutive older prompts, not the
    prompts' own spread over sqrt(recent): consecutive prompts are often pieces of one document or one
    user's session (the held-out standard library's correlate 0.21 with their neighbours): counted as
    independent, 2,400 of them in order gave z spread 1.5 (not 1) and 4.8 at most; as blocks, 1.03 and
    3.2."""
    n = surprise.shape[0]
    if n < recent + older:
        return None
    old, new = surprise[:n - recent], surprise[n - recent:]
    sums = np.concatenate([[0.0], np.cumsum(old)])
    block_means = (sums[recent:] - sums[:-recent]) / recent
    spread = float(block_means.std(ddof=1))
    if not spread > 0:
        return None
    return (float(new.mean()) - float(old.mean())) / (spread * math.sqrt(1.0 + recent / old.shape[0]))
