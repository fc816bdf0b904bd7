"""One rank of `python -m tools.check_gpu_paths gloo-ops` (imports only torch, to start fast).

    python -m tools.gloo_ops_rank DEVICE INIT_METHOD RANK OP[,OP...]

Runs each op over a 2-rank gloo group with tensors on DEVICE, in order, and prints
`RESULT <op> works|wrong|error <message>` as each one ends.
"""

import sys

import torch
import torch.distributed as dist


def trial(op: str, device, rank: int) -> bool:
    """Whether `op` gives the exact result; raises what the backend raises."""
    x = torch.arange(6, dtype=torch.float32, device=device) + 10 * rank
    sent = [torch.arange(6.0) + 10 * r for r in range(2)]  # what each rank holds, on the host
    if op == "all_gather":
        pieces = [torch.empty_like(x) for _ in range(2)]
        dist.all_gather(pieces, x)
        return all(torch.equal(p.cpu(), s) for p, s in zip(pieces, sent))
    if op == "all_reduce":
        dist.all_reduce(x)
        return torch.equal(x.cpu(), sent[0] + sent[1])
    if op == "broadcast":
        dist.broadcast(x, src=0)
        return torch.equal(x.cpu(), sent[0])
    if op == "all_to_all_single":  # piece i of every rank goes to rank i
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x)
        return torch.equal(out.cpu(), torch.cat([s[3 * rank : 3 * rank + 3] for s in sent]))
    if op == "batch_isend_irecv":
        received, peer = torch.empty_like(x), 1 - rank
        ops = [dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, received, peer)]
        for work in dist.batch_isend_irecv(ops if rank == 0 else ops[::-1]):
            work.wait()
        return torch.equal(received.cpu(), sent[peer])
    raise ValueError(f"unknown op {op!r}")


def main() -> None:
    device, init, rank, ops = torch.device(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4].split(",")
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)  # set_device needs an index
        torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    for op in ops:
        try:
            verdict = "works" if trial(op, device, rank) else "wrong"
        except Exception as exc:  # noqa: BLE001 - the result to report
            verdict = f"error {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        print(f"RESULT {op} {verdict}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
