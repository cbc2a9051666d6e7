"""Run a function on N spawned ranks (gloo on 127.0.0.1) and collect what each returns; the rank bodies the
tensor-parallel tests run live here, where spawned children can import them."""

from __future__ import annotations

import pickle
import queue
import traceback

import torch
import torch.multiprocessing as mp

from jetserve.distributed.group import free_port, init_tensor_parallel


def _entry(rank: int, world_size: int, port: int, fn, args: tuple, results) -> None:
    torch.set_num_threads(1)
    try:
        group = init_tensor_parallel(rank, world_size, port, torch.device("cpu"))
        out = fn(group, *args)
        group.barrier()
        group.destroy()
        results.put((rank, "ok", pickle.dumps(out)))  # plain bytes: no shared-memory handles outlive the rank
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        raise


def run_ranks(fn, world_size: int, *args, timeout_s: float = 120.0) -> list:
    """`fn(group, *args)` on every rank; returns the ranks' results in rank order (fn must be importable)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, results), daemon=True)
             for r in range(world_size)]  # fmt: skip
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    try:
        for _ in range(world_size):
            rank, status, value = results.get(timeout=timeout_s)
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            out[rank] = pickle.loads(value)
    except queue.Empty as e:
        raise AssertionError(f"ranks did not finish in {timeout_s}s (got {sorted(out)})") from e
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world_size)]


# ---- rank bodies ----


def greedy_run(model, prompts: list[list[int]], num_steps: int) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Prefill every prompt in one batch, then `num_steps` batched greedy decode steps on a StaticCache; returns
    the logits of each step [N, V] and the tokens chosen per sequence."""
    from jetserve.model.static_cache import StaticCache

    cache = StaticCache(model, num_seqs=len(prompts), max_tokens=128, page_size=4)
    seq_ids = list(range(len(prompts)))
    all_logits, tokens = [], [[] for _ in prompts]
    batch = prompts
    with torch.inference_mode():
        for _ in range(num_steps + 1):
            fb = cache.batch(seq_ids, batch)
            hidden = model(fb)  # [T, hidden]
            logits = model.compute_logits(hidden[fb.cu_seqlens[1:].long() - 1])  # [N, V]
            all_logits.append(logits.clone())
            chosen = logits.argmax(-1).tolist()
            for i, t in enumerate(chosen):
                tokens[i].append(t)
            batch = [[t] for t in chosen]
    return all_logits, tokens


def verify_run(model, prompt: list[int], chain: list[int], num_accepted: int) -> list[torch.Tensor]:
    """Prefill `prompt[:-1]`, verify the chain [prompt[-1], *chain] (logits at every node), commit its first
    `num_accepted` nodes, then decode the next node's token: the logits of the verify and of that decode step."""
    from jetserve.model.static_cache import StaticCache

    cache = StaticCache(model, num_seqs=1, max_tokens=128, page_size=4)
    nodes = [prompt[-1], *chain]
    with torch.inference_mode():
        model(cache.batch([0], [prompt[:-1]]))
        parents = torch.arange(-1, len(nodes) - 1, dtype=torch.int32)[None]  # [1, T_d]: a chain
        fb = cache.verify_batch([0], torch.tensor([nodes]), parents)
        verify_logits = model.compute_logits(model(fb))  # [T_d, V]
        accepted = torch.arange(len(nodes))[None]  # [1, T_d]
        model.commit_verified(fb, accepted, torch.tensor([num_accepted]))
        cache.commit([0], [num_accepted])
        fb = cache.batch([0], [[nodes[num_accepted]]])
        static = torch.full((1, verify_logits.shape[-1]), float("nan"))  # as a decode graph's buffer
        decode_logits = model.compute_logits(model(fb), static)  # [1, V], into `static`
        assert decode_logits is static
    return [verify_logits.clone(), decode_logits.clone()]


def tensor_parallel_greedy(
    group, checkpoint: str, prompts: list[list[int]], num_steps: int, chain: list[int], num_accepted: int
) -> dict:
    """Load this rank's shard and run `greedy_run`; also report the parameter shapes and what was read."""
    import jetserve.distributed.loader as loader

    reads: dict[str, tuple[int, ...]] = {}
    opened = loader.open_checkpoint

    class Recording:
        """A checkpoint handle that records each slice read and forbids whole-tensor reads."""

        def __init__(self, *args, **kwargs) -> None:
            self.handle = opened(*args, **kwargs)

        def __enter__(self):
            self.file = self.handle.__enter__()
            return self

        def __exit__(self, *exc) -> None:
            self.handle.__exit__(*exc)

        def keys(self):
            return self.file.keys()

        def get_tensor(self, name: str):
            raise AssertionError(f"{name}: read whole")

        def get_slice(self, name: str):
            inner = self.file.get_slice(name)

            class Slice:
                def get_shape(self):
                    return inner.get_shape()

                def __getitem__(self, index):
                    part = inner[index]
                    assert name not in reads, f"{name}: read twice"
                    reads[name] = tuple(part.shape)
                    return part

            return Slice()

    loader.open_checkpoint = Recording
    try:
        model = loader.load_sharded_model(checkpoint, group, dtype="float32")
    finally:
        loader.open_checkpoint = opened
    logits, tokens = greedy_run(model, prompts, num_steps)
    verify = verify_run(model, prompts[1], chain, num_accepted)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    return {"logits": logits, "tokens": tokens, "verify": verify, "shapes": shapes, "reads": reads}
