"""Migration and double-buffering logic on the CPU: batching, ordering, in-flight pages, bytes."""

import os


import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from kvtier import BlockTable, KVLayout  # noqa: E402
from kvtier.errors import ConfigError  # noqa: E402
from kvtier.mover.paged_io import read_tokens, write_tokens  # noqa: E402
from kvtier.mover import TransferEngine  # noqa: E402
from kvtier.mover.copy_kernel import copy_pages  # noqa: E402
from kvtier.tiers import DeviceTier, HostTier  # noqa: E402

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="bfloat16")


class ManualEvent:
    """A completion event the test lands by hand (a CUDA event's query/synchronize contract)."""

    log: list = []

    def __init__(self):
        self.done = False

    def record(self, stream=None):
        ManualEvent.log.append(self)

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True


def filled_table(device_pages=8, host_pages=8, event_factory=None, method="auto"):
    table = BlockTable(LAYOUT, [DeviceTier(LAYOUT, device_pages, device="cpu"), HostTier(LAYOUT, host_pages)])
    table.add_sequence(0)
    table.append(0, 20)  # 5 pages
    kv = torch.randn(LAYOUT.num_layers, 2, 20, 2, 8).to(LAYOUT.dtype)
    for layer in range(LAYOUT.num_layers):
        write_tokens(table, layer, 0, kv[layer], 0)
    return table, TransferEngine(table, event_factory=event_factory, method=method), kv


INTERPRETED = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="the copy kernel on CPU pools: the interpreter only")


@INTERPRETED
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_copy_kernel_moves_scattered_pages_bit_exact(dtype):
    src = torch.randn(12, 2, 4, 2, 8).to(dtype)
    dst = torch.randn(9, 2, 4, 2, 8).to(dtype)
    s, d = torch.tensor([11, 0, 5, 7, -1]), torch.tensor([2, 8, 0, 3, 6])  # a negative source: skipped
    want = dst.clone()
    want[d[:4]] = src[s[:4]]
    copy_pages(src, s, dst, d, device=torch.device("cpu"))
    assert torch.equal(dst.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("method", [pytest.param("kernel", marks=INTERPRETED), "generic"])
def test_migration_round_trip_counts_bytes_per_link(method):
    table, transfer, kv = filled_table(method=method)
    pids = table.pages(0)
    transfer.migrate(0, pids[:3], dst=1)
    transfer.migrate(0, pids[:2], dst=0)
    assert transfer.bytes_moved["device->host"] == 3 * LAYOUT.page_bytes
    assert transfer.bytes_moved["host->device"] == 2 * LAYOUT.page_bytes
    assert transfer.pages_moved["device->host"] == 3
    assert torch.equal(read_tokens(table, 0, 0).view(torch.int16), kv[0].view(torch.int16))


def test_source_slots_held_until_copy_lands_and_reads_wait():
    table, transfer, kv = filled_table(event_factory=ManualEvent)
    pids = table.pages(0)
    used_before = table.tiers[0].num_used(0)
    transfer.migrate(0, pids[:2], dst=1)
    assert transfer.in_flight(0, pids).tolist() == [True, True, False, False, False]
    assert table.tier_of[0, pids[:2]].tolist() == [1, 1]  # the table points at the destination already
    assert table.tiers[0].num_used(0) == used_before  # but the source slots are not reusable yet
    transfer.wait(0, pids[2:])  # pages not in flight: no wait
    assert transfer.stalls == 0
    transfer.wait(0, pids[:1])  # a read of an in-flight page waits for its copy
    assert transfer.stalls == 1 and not transfer.in_flight(0, pids).any()
    assert table.tiers[0].num_used(0) == used_before - 2  # released once landed
    assert torch.equal(read_tokens(table, 0, 0).view(torch.int16), kv[0].view(torch.int16))


def test_second_move_of_a_page_waits_for_the_first():
    table, transfer, _ = filled_table(event_factory=ManualEvent)
    pid = table.pages(0)[:1]
    transfer.migrate(0, pid, dst=1)
    first = ManualEvent.log[-1]
    transfer.migrate(0, pid, dst=0)  # ordering: must not copy from a slot still being written
    assert first.done
    assert table.tier_of[0, pid[0]] == 0


def test_full_destination_waits_for_pending_releases():
    table, transfer, _ = filled_table(device_pages=5, event_factory=ManualEvent)
    pids = table.pages(0)
    transfer.migrate(0, pids[:3], dst=1)  # device slots still held: 5 of 5 used
    assert table.tiers[0].num_free(0) == 0
    transfer.migrate(0, pids[:1], dst=0)  # needs a device slot: lands the pending demotion first
    assert table.tier_of[0, pids[0]] == 0 and table.tiers[0].num_used(0) == 3


def test_unknown_method_is_a_config_error():
    table, _, _ = filled_table()
    with pytest.raises(ConfigError) as e:
        TransferEngine(table, method="dma")
    assert e.value.field == "transfer.method"
