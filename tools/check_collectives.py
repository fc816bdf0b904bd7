"""Every transfer the modes make, over the real groups, on every rank: exact, and how fast.

    torchrun --standalone --nproc_per_node 2 -m tools.check_collectives [--mib 64] [--iters 5]

NCCL on GPUs (a GPU per rank), gloo on CPU. For each topology the modes build at this world
size (pure Ulysses, pure ring, and Ulysses x ring when there are 4 ranks or more), it makes the
groups as the modes do (core/groups.py: bound to the rank's GPU on NCCL), then runs on them the
package's own transfers with values every rank can predict:

  all_gather      collectives.all_gather over the SP group (decoding, checks, document_split's layout)
  broadcast       collectives.broadcast from the last rank (a hybrid's state after the prefill)
  all_reduce      torch's over the SP group (the loss, gradients under DDP)
  all_to_all      exchange.seq_to_heads then heads_to_seq over the Ulysses group (ulysses_attn)
  ring p2p        p2p.exchange, batched isend/irecv to the next rank and from the previous one
                  over the ring group (zigzag_ring_attn, dist_flash_attn, usp_attn's ring)
  one-way p2p     p2p.exchange with sends that no receive on the peer's side answers in the
                  same batch (dist_flash_attn's helper rounds: a rank sends, its peer only
                  receives)

One table row per transfer and topology: the group's ranks, MiB per rank, the median time and
whether every rank's result was exact. Exit 1 when any result is wrong.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist

from easy_context.core import collectives, exchange, p2p
from easy_context.core.groups import Topology, get_groups, group_device
from tools.check_generate import timed


def _expected(rank: int, numel: int, device) -> torch.Tensor:
    """What rank `rank` holds: values no other rank holds, exact in fp32."""
    return torch.arange(numel, dtype=torch.float32, device=device) % 1024 + 2048 * rank


def _median_ms(run, iters: int, device) -> float:
    return statistics.median(timed(device, run)[1] for _ in range(iters)) * 1e3


def _global(group, rank_in_group: int) -> int:
    return dist.get_global_rank(group, rank_in_group)


def transfers(groups, numel: int, device) -> dict:
    """name -> (group, a callable returning whether this rank's result is exact)."""
    found = {}
    if groups.sp is not None:
        found.update(_sp_transfers(groups.sp, numel, device))
    if groups.ulysses is not None:
        found["all_to_all"] = (groups.ulysses, _all_to_all(groups.ulysses, numel, device))
    if groups.ring is not None:
        found.update(_ring_transfers(groups.ring, numel, device))
    return found


def _sp_transfers(sp, numel: int, device) -> dict:
    mine, size = _expected(dist.get_rank(), numel, device), dist.get_world_size(sp)

    def all_gather():
        pieces = collectives.all_gather(mine, sp)
        return all(torch.equal(p, _expected(_global(sp, i), numel, device)) for i, p in enumerate(pieces))

    def broadcast():
        got = collectives.broadcast(mine.clone(), size - 1, sp)
        return torch.equal(got, _expected(_global(sp, size - 1), numel, device))

    def all_reduce():
        total = mine.clone()
        dist.all_reduce(total, group=sp)
        return torch.equal(total, sum(_expected(_global(sp, i), numel, device) for i in range(size)))

    return {"all_gather": (sp, all_gather), "broadcast": (sp, broadcast), "all_reduce": (sp, all_reduce)}


def _all_to_all(ulysses, numel: int, device):
    """(1, H, S/U, D) sequence shards of one (1, H, S, D) tensor every rank can make, to head
    shards and back."""
    size, me = dist.get_world_size(ulysses), dist.get_rank(ulysses)
    heads, dim = 4 * size, 64
    seq = max(size, numel // (heads * dim)) // size * size
    whole = torch.arange(heads * seq * dim, dtype=torch.float32, device=device).reshape(1, heads, seq, dim)
    shard = whole[:, :, me * seq // size : (me + 1) * seq // size].contiguous()
    want = whole[:, me * heads // size : (me + 1) * heads // size]

    def all_to_all():
        by_heads = exchange.seq_to_heads(shard, ulysses)
        return torch.equal(by_heads, want) and torch.equal(exchange.heads_to_seq(by_heads, ulysses), shard)

    return all_to_all


def _ring_transfers(ring, numel: int, device) -> dict:
    mine = _expected(dist.get_rank(), numel, device)
    size, me = dist.get_world_size(ring), dist.get_rank(ring)
    after, before = (me + 1) % size, (me - 1) % size
    from_before = _expected(_global(ring, before), numel, device)

    def ring_p2p():
        (got,) = p2p.exchange(ring, [(after, mine, mine)], [(before, p2p.buffer_like(mine))]).wait()
        return torch.equal(got, from_before)

    def one_way_p2p():  # even ranks send to the next one, odd ranks receive from the previous one
        if me % 2 == 0 and after % 2 == 1:
            p2p.exchange(ring, [(after, mine, mine)], []).wait()
        elif me % 2 == 1:
            (got,) = p2p.exchange(ring, [], [(before, p2p.buffer_like(mine))]).wait()
            return torch.equal(got, from_before)
        return True

    return {"ring_p2p": (ring, ring_p2p), "one_way_p2p": (ring, one_way_p2p)}


def topologies(world: int) -> list[tuple[str, Topology]]:
    found = [("ulysses", Topology(world, world, 1)), ("ring", Topology(world, world, world))]
    middle = [d for d in range(2, world) if world % d == 0]
    if middle:
        found.append((f"ulysses x ring ({world // middle[0]} x {middle[0]})", Topology(world, world, middle[0])))
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=float, default=None, help="MiB per rank and transfer (default 64 GPU, 1 CPU)")
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        parser.error("run it under torchrun: torchrun --standalone --nproc_per_node 2 -m tools.check_collectives")
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = group_device() or torch.device("cpu")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world < 2:
        parser.error("needs 2 ranks or more")
    numel = int((args.mib or (64 if cuda else 1)) * 2**20 / 4)
    rows, ok = [], True
    for name, topology in topologies(world):
        groups = get_groups(topology)
        for op, (group, run) in transfers(groups, numel, device).items():
            exact = run()  # the first call checks; the timed ones repeat it
            ms = _median_ms(run, args.iters, device)
            verdict = torch.tensor([int(exact)], device=device)
            dist.all_reduce(verdict, op=dist.ReduceOp.MIN)  # every group has run: all ranks are here
            exact_everywhere = bool(verdict.item())
            ok &= exact_everywhere
            ranks = dist.get_process_group_ranks(group)
            rows.append(f"| {name} | {op} | {ranks} | {numel * 4 / 2**20:.0f} | {ms:.2f} | {exact_everywhere} |")
    if rank == 0:
        print(f"{world} ranks, {dist.get_backend()}, {device}; the worst rank decides 'exact'")
        print("| topology | transfer | group (rank 0's) | MiB per rank | ms (median) | exact on every rank |")
        print("|---|---|---|---|---|---|")
        print("\n".join(rows))
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
