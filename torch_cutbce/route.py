"""The route of one torch call: where and how it runs, apart from what it computes (the `Loss`).

`Route(options, vocab_parallel)`: the call's `CutBCEOptions` (tile width, metrics, the torch_xla
mesh, the vocabulary-parallel offset, and the `Loss` they carry to the custom ops as one string)
and, for `vocab_parallel=`, this rank's `VocabParallelOptions` (its process group cannot cross an
op boundary as a string, so it travels beside the options). Every torch engine takes one `Route`
(`engines.py`). This module imports no engine, so the registry, the layouts and `arguments.py`
(which the native ops import) all import it without a cycle.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from cutbce_common.options import CutBCEOptions


@dataclasses.dataclass(frozen=True)
class VocabParallelOptions:
    """This rank's share of the item table.

    Attributes:
      start, stop: the global item ids `[start, stop)` whose rows this rank holds.
      num_items: the global V (for 'mean', which divides by N x V, and the id check).
      group: the process group the table is split over (None: the default group).
    """

    start: int
    stop: int
    num_items: int
    group: object = None

    def __post_init__(self):
        if not 0 <= self.start < self.stop <= self.num_items:
            raise ValueError(f"need 0 <= start < stop <= num_items, got {self.start=}, {self.stop=}, {self.num_items=}")

    @classmethod
    def even(cls, num_items: int, group=None) -> "VocabParallelOptions":
        """Contiguous slices of ceil(V / world) rows, the last one shorter (rank r gets slice r)."""
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        chunk = -(-num_items // world)
        if chunk * (world - 1) >= num_items:
            raise ValueError(f"V={num_items} items cannot give each of {world} ranks a non-empty slice of {chunk}")
        return cls(rank * chunk, min((rank + 1) * chunk, num_items), num_items, group)



@dataclasses.dataclass(frozen=True)
class Route:
    """The call's options and, for a vocabulary-parallel call, this rank's slice of the table."""

    options: CutBCEOptions
    vocab_parallel: VocabParallelOptions | None = None
