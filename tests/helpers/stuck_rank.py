"""A rank that waits in a collective the other rank never joins (tests/integration/test_ranks.py): `python stuck_rank.py
RANK PORT`. Rank 0 installs vtrain's signal handling and waits in a gloo barrier; rank 1 joins the group and then
only sleeps, so rank 0 stays inside native code, where Python runs no signal handler."""

import sys
import time

import torch.distributed as dist

from vtrain.engine.interrupt import GracefulInterrupt


def main() -> None:
    rank, port = int(sys.argv[1]), sys.argv[2]
    if rank == 0:
        GracefulInterrupt().install()
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    if rank == 0:
        print("waiting in a barrier", flush=True)
        dist.barrier()
        print("left the barrier", flush=True)
    else:
        time.sleep(600)


if __name__ == "__main__":
    main()
