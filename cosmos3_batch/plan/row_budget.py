"""How many rows one batched layer call may join (`--max-batch-rows`), and the largest group it makes.

With `--batch-branches` (the GPU default) a rank applies each layer part to its branches with their rows
joined (model/batched.py); the transient of that call grows with the rows: above all the MLP's gate, up
and their product. Nano's GEN half holds ~100 KB of transient per row in bf16 (3 x 12,288 x 2 B for the
MLP; q/k/v, the attention output and the residual), so 65,536 rows are ~6.6 GB beside the 1.2 GB of
weight slots: room on an 80 GB GPU with the VAE decode and a K=4 720p job's kept activations. A
1280x720, 189-frame branch (44,160 rows) runs whole; K=4 with CFG at that size is 8 groups of one branch
instead of one group of 353,280 rows (~35 GB of transient). Torch-free.
"""

from __future__ import annotations

MAX_BATCH_ROWS = 65536


def largest_group(rows_per_seq: int, seqs: int, max_rows: int | None) -> int:
    """Sequences in the largest group `model/batched.py row_groups` makes of `seqs` equal sequences."""
    if seqs <= 0:
        return 0
    if max_rows is None or rows_per_seq <= 0:
        return seqs
    return max(1, min(seqs, max_rows // rows_per_seq))
