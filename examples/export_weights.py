"""Pushing a trainer's weights to an inference model after each step (``fsdp.export``).

``python -m examples.export_weights`` (from the root of a clone) spawns two CPU ranks that train a
small GPT under FSDP; after each step rank 0's "inference engine" (here a plain copy of the model
in bf16) receives the weights:

- the first time as a stream of full parameters, bucket by bucket, one FSDP unit gathered at a
  time (``full_params_stream``);
- then only what changed, against a host snapshot (``full_params_delta``), each parameter checked
  by its checksum (``apply_delta``).

It ends by checking that the engine holds exactly the trainer's weights in bf16. Then the
trainer is written as Hugging Face safetensors files (``save_safetensors``: rank 0 writes, one
unit gathered at a time, names as the plain model's), split into files of at most 16 KiB with
``model.safetensors.index.json``, and read back into a plain model (with the ``safetensors``
package, when it is installed: ``pip install -e ".[stacks]"``).
"""

from __future__ import annotations

import gc
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

WORLD_SIZE = 2


def export_demo(steps: int = 3) -> bool:
    """The demo on an initialized process group; True on rank 0 when the engine matches."""
    from fsdp import FullyShardedDataParallel as FSDP
    from fsdp.export import apply_delta, full_params_delta, full_params_stream
    from fsdp.plan.gpt import GPT, Block, GPTConfig
    from fsdp.wrap import ModuleWrapPolicy

    rank = dist.get_rank()
    config = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, d_model=32)
    torch.manual_seed(0)
    trainer = FSDP(GPT(config), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"))
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-3)
    engine = GPT(config).to(torch.bfloat16) if rank == 0 else None  # the inference side, rank 0 only
    engine_state = engine.state_dict() if engine is not None else {}

    # 1. The whole model, streamed in 64 KiB buckets of bf16 tensors, named as the plain model's.
    for bucket in full_params_stream(trainer, dtype=torch.bfloat16, bucket_bytes=64 << 10, rank0_only=True):
        for name, tensor in bucket:
            engine_state[name].copy_(tensor)
    snapshot: dict[str, torch.Tensor] = {}  # what the engine holds, on the host; ours to keep
    for _ in full_params_delta(trainer, snapshot, dtype=torch.bfloat16, rank0_only=True):
        pass  # fills the snapshot (the engine already has these values)

    for step in range(steps):
        torch.manual_seed(100 * step + rank)
        tokens = torch.randint(0, config.vocab_size, (4, config.block_size + 1))
        logits = trainer(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
        # 2. Only the changed elements, each parameter verified by its checksum.
        sent = 0
        for deltas in full_params_delta(trainer, snapshot, dtype=torch.bfloat16, rank0_only=True):
            for delta in deltas:
                apply_delta(engine_state[delta.name], delta)
                sent += delta.nbytes
        if rank == 0:
            print(f"step {step}: sent {sent} bytes of deltas")

    with FSDP.summon_full_params(trainer, writeback=False):
        expected = {name: p.detach().to(torch.bfloat16) for name, p in trainer.named_parameters()}
    if rank != 0:
        return True
    return all(torch.equal(engine_state[name], value) for name, value in expected.items())


def safetensors_demo(folder: str) -> bool:
    """Writes a trainer as safetensors files in ``folder`` and loads them into a plain model; True
    on every rank when it matches (reading back needs the ``safetensors`` package)."""
    from fsdp import FullyShardedDataParallel as FSDP
    from fsdp.export import save_safetensors
    from fsdp.plan.gpt import GPT, Block, GPTConfig
    from fsdp.wrap import ModuleWrapPolicy

    config = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, d_model=32)
    torch.manual_seed(0)
    trainer = FSDP(GPT(config), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"))
    # Every rank calls it; rank 0 writes. config= would also write config.json (a transformers
    # config or a dict), which from_pretrained needs.
    written = save_safetensors(trainer, folder, dtype=torch.bfloat16, max_shard_size=16 << 10)
    dist.barrier()  # the files are complete once rank 0 returns
    with FSDP.summon_full_params(trainer, writeback=False):
        expected = {name: p.detach().to(torch.bfloat16) for name, p in trainer.named_parameters()}
    if dist.get_rank() != 0:
        return True
    print("wrote", ", ".join(sorted(written)))
    from safetensors.torch import load_file

    loaded: dict[str, torch.Tensor] = {}
    for name in written:
        if name.endswith(".safetensors"):
            loaded.update(load_file(os.path.join(folder, name)))
    engine = GPT(config).to(torch.bfloat16)
    engine.load_state_dict(loaded, strict=False)  # a tied weight is stored once, as from save_pretrained
    state = engine.state_dict()
    return set(loaded) <= set(expected) and all(torch.equal(state[name], value) for name, value in expected.items())


def _worker(rank: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    try:
        ok = export_demo()
        if rank == 0:
            print("engine matches the trainer bit for bit (bf16):", ok)
        try:
            import safetensors  # noqa: F401
        except ImportError:
            if rank == 0:
                print("safetensors is not installed: skipping the safetensors files")
        else:
            ok_files = safetensors_demo(os.path.join(os.path.dirname(init_file), "safetensors"))
            if rank == 0:
                print("safetensors files hold the trainer's weights bit for bit (bf16):", ok_files)
            ok = ok and ok_files
        # Leave together: tearing gloo down while a peer still finishes its last collective
        # can abort the process at exit.
        dist.barrier()
        if not ok:
            raise SystemExit(1)
    finally:
        # The model is gone, but reference cycles from torch's lazy imports can still hold the
        # process group: collect them so destroy_process_group() stops gloo's threads before
        # the interpreter shuts down (as examples/train.py does).
        gc.collect()
        dist.destroy_process_group()


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(os.path.join(tmp, "rendezvous"),), nprocs=WORLD_SIZE)


if __name__ == "__main__":
    main()
