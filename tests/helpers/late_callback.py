"""A rank whose native thread needs Python while the process ends (tests/integration/test_ranks.py): `python
late_callback.py RANK PORT vtrain|interpreter`.

Rank 0 starts an all-reduce with a Python callback (which runs on gloo's worker thread once the collective
completes, and needs the GIL there) and leaves at once; rank 1 joins the collective 1.5 s later. With
`interpreter`, rank 0 ends as any Python program does: its teardown (slowed by an object whose finaliser waits 3 s
with the GIL released, as a big teardown would) is under way when the callback's thread asks for the GIL, and
Python 3.11 ends that thread with pthread_exit, whose unwinding aborts the process. With `vtrain`, it ends
through the CLI's own exit (vtrain/cli.py `_exit`), which never tears the interpreter down."""

import os
import sys
import time

import torch
import torch.distributed as dist


class SlowTeardown:
    def __del__(self, sleep=time.sleep):  # bound now: `time` is gone by the time this runs
        sleep(3)


def main() -> None:
    rank, port, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    if rank == 1:
        time.sleep(1.5)
        try:
            dist.all_reduce(torch.ones(4))
        except RuntimeError:  # rank 0 may be gone already: what this rank does is not under test
            pass
        time.sleep(5)
        os._exit(0)
    work = dist.all_reduce(torch.ones(4), async_op=True)
    globals()["pending"] = work.get_future().then(lambda f: f.value())
    globals()["slow"] = SlowTeardown()
    print("rank 0 leaves", flush=True)
    if mode == "vtrain":
        from vtrain.cli import _exit

        _exit(0, 0)
    sys.exit(0)


if __name__ == "__main__":
    main()
