"""The mover: data movement apart from storage (the tiers) and bookkeeping (the block table).

:class:`~kvtier.mover.transfer.TransferEngine` copies pages between tiers and keeps the byte ledger;
:mod:`~kvtier.mover.copy_kernel` is the one-launch page copy it and the recall cache use;
:mod:`~kvtier.mover.paged_io` writes a step's K/V into its pages; :mod:`~kvtier.mover.staging` stages disk
and remote pages a step reads into pinned memory.
"""

from kvtier.mover.transfer import TransferEngine

__all__ = ["TransferEngine"]
