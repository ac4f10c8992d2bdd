"""Where the positives are: padded target ids -> a set of ids per row -> a mask per logits tile.

The positives are taken out of the dense pass inside the tile where they fall (DESIGN.md
section 2, Precision): each element's loss is `softplus(z)` or `pw softplus(-z)`, chosen
element by element, never `softplus(z)` summed and `z` subtracted later. The tile needs to know
which of its `[N, block_v]` elements are positives; `TileTargets` marks them in a reused boolean
buffer by a scatter of the O(N L) ids that fall into the tile, and unmarks them afterwards, so no
`[N, block_v]` fill is paid per tile.
"""

from __future__ import annotations

import torch


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; float32, bfloat16 and float16 accumulate in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def positive_ids(targets: torch.Tensor, num_items: int, offset: int = 0) -> torch.Tensor:
    """Padded ids `[N, L]` -> `[N, L]` int64 ids in `[0, num_items)`, each valid id once, -1 elsewhere.

    An id t is valid iff `offset <= t < offset + num_items`; it becomes `t - offset` (a rank's or
    shard's local id). Comparisons run in int64 before any narrowing, so no id can
    wrap into another item (every accepted id dtype widens to int64 losslessly). Sorting puts
    duplicates side by side ("first of its run" dedupes).
    """
    ids = targets.long().sort(dim=-1).values  # widening: int8/uint8/int16 ids would wrap V in their dtype
    keep = (ids >= offset) & (ids < offset + num_items)
    keep[:, 1:] &= ids[:, 1:] != ids[:, :-1]
    local = ids - offset if offset else ids
    return torch.where(keep, local, torch.full_like(local, -1))


class TileTargets:
    """Boolean `[N, stop - start]` masks of the positives of each vocabulary tile `[start, stop)`.

    One flat buffer of `N * block_v + 1` booleans, all False between tiles: `mark` sets the
    tile's positives (ids outside the tile go to the spare last slot), `unmark` clears the same
    slots. Both cost O(N L), independent of the tile's size. Tiles start at multiples of
    `block_v`, so each id's tile and column are computed once, not per tile.
    """

    def __init__(self, ids: torch.Tensor, block_v: int):
        n = ids.shape[0]
        self.num_rows, self.block_v, self.spare = n, block_v, n * block_v
        self.buffer = torch.zeros(self.spare + 1, dtype=torch.bool, device=ids.device)
        self.tile = torch.where(ids >= 0, torch.div(ids, block_v, rounding_mode="floor"), -1)
        self.row = torch.arange(n, device=ids.device).unsqueeze(-1)
        self.column = ids - self.tile * block_v
        self.slots = None

    def mark(self, start: int, stop: int) -> torch.Tensor:
        width = stop - start
        flat = self.row * width + self.column
        self.slots = torch.where(self.tile == start // self.block_v, flat, self.spare).reshape(-1)
        self.buffer.index_fill_(0, self.slots, True)
        return self.buffer[: self.num_rows * width].view(-1, width)

    def unmark(self) -> None:
        self.buffer.index_fill_(0, self.slots, False)


def num_positives(ids: torch.Tensor) -> torch.Tensor:
    """`|T_n|` per row as float32 (the metrics' TP + FN)."""
    return (ids >= 0).sum(-1, dtype=torch.float32)
