"""KV blocks a step must find free for the users with budget to be admitted.

Rule 1 of ``residency.py`` preempts throttled residents for claimants when
KV space is tight; these functions say how tight is tight, from vLLM's own
numbers (block size, watermark, ``--max-model-len``, whether admission
checks the whole prompt). They read the scheduler only through
``seams.SchedulerHost``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from vllm_output_rate.scheduling.demand import user_of
from vllm_output_rate.seams import kv_watermark_blocks, num_free_kv_blocks

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from vllm_output_rate.seams import SchedulerHost


def blocks_for(host: SchedulerHost, num_tokens: int) -> int:
    """KV blocks that ``num_tokens`` tokens take."""
    return -(-num_tokens // host.block_size)


def margin(host: SchedulerHost) -> int:
    """Blocks to keep free beside any admission: the running requests
    decoding in this step may each start a new block (on average one in
    block_size does), and vLLM's watermark stays free."""
    return kv_watermark_blocks(host) + len(host.running) // host.block_size + 1


def blocks_bound(host: SchedulerHost, claimants: int) -> int:
    """Free KV blocks above which no claimant's admission can fail."""
    return claimants * blocks_for(host, host.max_model_len) + margin(host)


def tight(host: SchedulerHost, claimants: int) -> bool:
    """Whether a claimant's admission may fail for lack of KV blocks."""
    return num_free_kv_blocks(host) < blocks_bound(host, claimants)


def blocks_needed(host: SchedulerHost, heads: Iterable[Request]) -> int:
    """KV blocks the claimants' admissions need free in this step
    (``admission_blocks`` each), plus the running requests' margin."""
    return margin(host) + sum(admission_blocks(host, r) for r in heads)


def admission_blocks(host: SchedulerHost, request: Request) -> int:
    """KV blocks a waiting request's admission needs free: its whole prompt
    if vLLM checks that it fits (its default), else one step's chunk."""
    tokens = request.num_tokens - request.num_computed_tokens
    if not host.scheduler_reserve_full_isl:
        tokens = min(tokens, host.max_num_scheduled_tokens)
    return blocks_for(host, tokens)


def admissible(host: SchedulerHost, heads: Iterable[Request]) -> int:
    """How many of the claimants' heads vLLM could admit together now.

    A head that must compute its output again (preempted after sampling)
    counts if its ``admission_blocks`` fit in the free KV blocks above the
    margin, the smallest first. A head with no output yet always counts:
    the prefix cache may hold its prompt, which only vLLM's admission can
    tell (as before this check, it is granted and vLLM decides)."""
    free = num_free_kv_blocks(host) - margin(host)
    count = 0
    recomputing = []
    for request in heads:
        if request.num_output_tokens:
            recomputing.append(admission_blocks(host, request))
        else:
            count += 1
    for need in sorted(recomputing):
        if need > free:
            break
        free -= need
        count += 1
    return count


def claimant_heads(
    waiting: Iterable[Request], wanted: Mapping[str, int]
) -> dict[str, Request]:
    """Each claimant's first waiting request, in vLLM's queue order."""
    heads: dict[str, Request] = {}
    claimants = {user for user, n in wanted.items() if n}
    for request in waiting:
        user = user_of(request)
        if user in claimants and user not in heads:
            heads[user] = request
            if len(heads) == len(claimants):
                break
    return heads
