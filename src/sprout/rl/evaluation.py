"""pass@k: the chance that at least one of k samples is correct, estimated from n >= k.

Chen et al. 2021 ("Evaluating Large Language Models Trained on Code"): from n samples of
which c are correct, the unbiased estimate is 1 - C(n - c, k) / C(n, k), the chance that a
k-subset drawn without replacement holds a correct sample. The binomials overflow floats
long before n is large, so it is computed as the product
1 - prod_{i = n-c+1}^{n} (1 - k / i), which is the same number. Averaged over problems,
each problem counts once (the normaliser of `mean_pass_at_k` is the number of problems).
"""

from __future__ import annotations

import math
from typing import Iterable


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with `c` correct among `n` samples."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def mean_pass_at_k(counts: Iterable[tuple[int, int]], k: int) -> float:
    """Mean of `pass_at_k` over problems given as (n, c) pairs."""
    values = [pass_at_k(n, c, k) for n, c in counts]
    if not values:
        raise ValueError("mean_pass_at_k needs at least one problem")
    return math.fsum(values) / len(values)
