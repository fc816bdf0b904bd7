"""Process groups at 4 gloo ranks: equal rank lists are one group object (one communicator),
across group kinds and across topologies, every rank creates the same groups in the same
order, and each group holds the ranks it should."""

import pytest
import torch
from ranks import run_ranks

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py)

# (world, sp_size, ring_degree), in the order every rank asks for them
TOPOLOGIES = [(4, 2, 2), (4, 2, 1), (4, 4, 2), (4, 4, 4), (4, 4, 1), (4, 1, 1)]


def groups_worker(rank, world_size):
    import torch.distributed as dist

    from easy_context.core.groups import Topology, get_groups, group_for, release_groups

    created = []
    original = dist.new_group

    def counting(ranks, *args, **kwargs):
        created.append(tuple(ranks))
        return original(ranks, *args, **kwargs)

    dist.new_group = counting
    seen, per_topology = [], []
    for shape in TOPOLOGIES:
        before = len(created)
        groups = get_groups(Topology(*shape))
        roles = {"sp": groups.sp, "ring": groups.ring, "ulysses": groups.ulysses}
        members, sums = {}, {}
        for name, group in roles.items():
            if group is None:
                continue
            members[name] = dist.get_process_group_ranks(group)
            total = torch.tensor([float(rank)])
            dist.all_reduce(total, group=group)
            sums[name] = total.item()
        seen.extend(g for g in roles.values() if g is not None and all(g is not s for s in seen))
        per_topology.append(
            {
                "new": len(created) - before,
                # which roles share one object, and which are the default group
                "same": {(a, b) for a in roles for b in roles if a < b and roles[a] is roles[b] is not None},
                "world": {name for name, g in roles.items() if g is dist.group.WORLD},
                "none": {name for name, g in roles.items() if g is None},
                "members": members,
                "sums": sums,
                # a group of an earlier topology, found again
                "reused": {name: next(i for i, s in enumerate(seen) if s is g) for name, g in roles.items() if g},
            }
        )
    lookups = {
        "reversed is sorted": group_for([1, 0]) is group_for([0, 1]),
        "whole world": group_for(range(world_size)) is dist.group.WORLD,
    }
    try:
        group_for([0, 0])
        lookups["refusal"] = None
    except ValueError as error:
        lookups["refusal"] = str(error)
    old = group_for([0, 1])
    release_groups()
    before = len(created)
    again = group_for([0, 1])
    # (ranks 2 and 3 get torch's one non-member handle both times)
    lookups["after release: a new group"] = (again is not old or rank > 1) and len(created) == before + 1
    dist.new_group = original
    return created, per_topology, lookups


@pytest.mark.timeout(200)
def test_equal_rank_lists_share_one_group_and_every_rank_agrees():
    results = run_ranks(groups_worker, 4)
    created = [r[0] for r in results]
    # the same new_group calls, in the same order, on every rank (collective creation)
    assert all(c == created[0] for c in created), created
    # one group per distinct rank list, never the world's: 12 new_group calls before sharing
    assert created[0] == [(0, 1), (2, 3), (0, 2), (1, 3)] + [(0, 1)]
    for rank, (_, per_topology, lookups) in enumerate(results):
        dp_pair = [0, 1] if rank < 2 else [2, 3]
        strided = [rank % 2, rank % 2 + 2]
        (t1, t2, t3, t4, t5, t6) = per_topology
        # dp 2 x sp 2, ring 2: SP and ring are one group, Ulysses is a rank alone
        assert (t1["new"], t1["same"], t1["none"]) == (2, {("ring", "sp")}, {"ulysses"})
        assert t1["members"] == {"sp": dp_pair, "ring": dp_pair} and t1["sums"]["sp"] == sum(dp_pair)
        # dp 2 x sp 2, ring 1: SP and Ulysses are one group, and it is the group above
        assert (t2["new"], t2["same"], t2["none"]) == (0, {("sp", "ulysses")}, {"ring"})
        assert t2["reused"] == {"sp": 0, "ulysses": 0} and t2["members"]["ulysses"] == dp_pair
        # sp 4 = ring 2 x Ulysses 2: SP is the default group, Ulysses the dp pair again, ring new
        assert (t3["new"], t3["world"], t3["same"]) == (2, {"sp"}, set())
        assert t3["members"] == {"sp": [0, 1, 2, 3], "ring": strided, "ulysses": dp_pair}
        assert t3["sums"] == {"sp": 6.0, "ring": float(sum(strided)), "ulysses": float(sum(dp_pair))}
        assert t3["reused"]["ulysses"] == 0
        # the whole world as a ring, then as Ulysses: the default group, nothing created
        assert (t4["new"], t4["world"], t4["none"]) == (0, {"sp", "ring"}, {"ulysses"})
        assert (t5["new"], t5["world"], t5["none"]) == (0, {"sp", "ulysses"}, {"ring"})
        # pure data parallel: no group at all
        assert (t6["new"], t6["none"]) == (0, {"sp", "ring", "ulysses"})
        assert lookups["reversed is sorted"] and lookups["whole world"]
        assert lookups["after release: a new group"]
        assert lookups["refusal"] == "ranks=[0, 0] is not a group of this world; give distinct ranks in [0, 3]"
