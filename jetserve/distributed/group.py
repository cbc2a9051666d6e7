"""Tensor-parallel process groups over torch.distributed: one process per rank, NCCL for tensors on GPUs (gloo on
the CPU), a gloo group for host-side messages; the three collectives the sharded model and the engine use."""

from __future__ import annotations

import pickle
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from jetserve import envs

# Rank 0 waits this long for the other ranks to join (they load their shards first), and a collective this long.
INIT_TIMEOUT = timedelta(minutes=30)
# The other ranks wait for rank 0's next step message as long as the server idles: in effect, forever.
MESSAGE_TIMEOUT = timedelta(days=365)
# The one-shot all-reduce (JETSERVE_TP_ALL_REDUCE=one-shot) takes messages up to this size (a decode step's hidden
# states: batch 256 of the 4B's 3072 in bf16 is 1.5 MiB); larger ones (prefill) go through NCCL.
ONE_SHOT_MAX_BYTES = 2 << 20


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (the rendezvous of the ranks of one engine)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass
class TensorParallelGroup:
    """The ranks of one tensor-parallel engine. `device_group` carries model tensors (NCCL on CUDA, so CUDA graphs
    capture its collectives); `cpu_group` (gloo) carries the host messages that keep the ranks' engines in step."""

    rank: int
    world_size: int
    device: torch.device
    device_group: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None
    one_shot_buffer: torch.Tensor | None = None  # [ONE_SHOT_MAX_BYTES] uint8 of symmetric memory, when enabled

    def enable_one_shot(self) -> None:
        """Sum small tensors with PyTorch's one-shot all-reduce over symmetric memory (a collective call: every rank
        makes it). Each rank copies its tensor into its symmetric buffer and one kernel reads every peer's buffer
        over NVLink and sums, instead of NCCL's ring with its fixed per-call latency."""
        from torch.distributed import _symmetric_memory as symm_mem

        assert self.device.type == "cuda" and self.world_size > 1
        buffer = symm_mem.empty(ONE_SHOT_MAX_BYTES, dtype=torch.uint8, device=self.device)
        symm_mem.rendezvous(buffer, self.device_group.group_name)
        self.one_shot_buffer = buffer

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns it."""
        if self.world_size == 1:
            return x
        nbytes = x.numel() * x.element_size()
        if self.one_shot_buffer is not None and nbytes <= ONE_SHOT_MAX_BYTES and x.is_contiguous():
            staging = self.one_shot_buffer[:nbytes].view(x.dtype).view(x.shape)
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(staging, x, "sum", self.device_group.group_name, x)
        else:
            dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """`x` [*S] from every rank → [world_size, *S] (rank order)."""
        if self.world_size == 1:
            return x.unsqueeze(0)
        out = torch.empty((self.world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x.contiguous(), group=self.device_group)  # ranks concatenated along dim 0
        return out.view(self.world_size, *x.shape)

    def broadcast_object(self, obj: object = None) -> object:
        """Rank 0's `obj` on every rank (the others pass None): a length, then the pickled bytes when there are any.
        An empty message (`obj` None) costs one 8-byte broadcast."""
        if self.world_size == 1:
            return obj
        header = torch.zeros(1, dtype=torch.int64)
        payload = b""
        if self.is_first and obj is not None:
            payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            header[0] = len(payload)
        dist.broadcast(header, src=0, group=self.cpu_group)
        size = int(header[0])
        if size == 0:
            return None
        buffer = (
            torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            if self.is_first
            else torch.empty(size, dtype=torch.uint8)
        )
        dist.broadcast(buffer, src=0, group=self.cpu_group)
        return obj if self.is_first else pickle.loads(buffer.numpy().tobytes())

    def all_reduce_min(self, value: int) -> int:
        """The smallest of every rank's `value` (host-side, over the gloo group)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t[0])

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.cpu_group)

    def destroy(self) -> None:
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def init_tensor_parallel(rank: int, world_size: int, port: int, device: torch.device) -> TensorParallelGroup:
    """Join the `world_size` ranks meeting at 127.0.0.1:`port` (tensor parallelism stays on one host)."""
    assert 0 <= rank < world_size
    if world_size == 1:
        return TensorParallelGroup(0, 1, device)
    is_cuda = device.type == "cuda"
    if is_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if is_cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=INIT_TIMEOUT if is_cuda else MESSAGE_TIMEOUT,
        device_id=device if is_cuda else None,
    )
    world = dist.group.WORLD
    cpu_group = dist.new_group(backend="gloo", timeout=MESSAGE_TIMEOUT) if is_cuda else world
    group = TensorParallelGroup(rank, world_size, device, world, cpu_group)
    if is_cuda and envs.tp_all_reduce() == "one-shot":
        group.enable_one_shot()
    return group
