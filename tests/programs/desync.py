"""A desync: after a warm-up all_reduce, rank 2 enters an all_reduce of the group [1, 2] while
ranks 0 and 1 enter the world's (hpcsync backend, HPCSYNC_TIMEOUT from the environment). Each
rank's wait times out; the records they write (HPCSYNC_REPORT_DIR) are the evidence."""
import torch
import torch.distributed as dist

import hpcsync

hpcsync.init(backend="hpcsync")
rank = dist.get_rank()
group = dist.new_group([1, 2])
t = torch.ones(4)
dist.all_reduce(t)
dist.all_reduce(t, group=group) if rank == 2 else dist.all_reduce(t)
