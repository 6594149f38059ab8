"""A plain user script of the DeepSpeed-style loop, with no clean-up code of its own.

    torchrun --standalone --nproc_per_node 2 tests/distributed/clean_exit_script.py [STAGE] [ENDING] [KEEP]

It builds a tiny model, calls ``hf_zero.initialize`` and takes two steps, then simply ends:
nothing calls ``destroy_process_group``, ``engine.close()`` or ``os._exit``, as in most users'
scripts. ``ENDING`` picks how the script ends: ``ok`` (falls off the end), ``raise`` (an
uncaught exception on every rank) or ``exit3`` (``sys.exit(3)``). ``KEEP`` = ``globals`` keeps the
model and engine in module globals, as a script written at top level does, so they (and the
process group they reference) live until the interpreter clears its modules. An ``atexit``
handler prints ``user atexit ran`` so the caller can see that users' exit handlers still run.
"""

from __future__ import annotations

import atexit
import sys

import torch
from torch import nn

import hf_zero


class TinyMLP(nn.Module):
    """Two linear blocks in a ModuleList, so stages 2/3 shard one unit per block."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(width, width), nn.Linear(width, width)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return x.pow(2).mean()


def main() -> None:
    stage = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    ending = sys.argv[2] if len(sys.argv) > 2 else "ok"
    keep = sys.argv[3] if len(sys.argv) > 3 else "locals"
    atexit.register(lambda: print("user atexit ran", flush=True))

    torch.manual_seed(0)
    model = TinyMLP()
    ds_config = {
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    engine = hf_zero.initialize(model=model, config=ds_config)
    for _ in range(2):
        loss = engine(torch.randn(4, 32))
        engine.backward(loss)
        engine.step()
    print(f"rank {engine.env.rank} done, loss {loss.item():.4f}", flush=True)
    if keep == "globals":
        globals().update(model=model, engine=engine)

    if ending == "raise":
        raise RuntimeError("the user's script failed after training")
    if ending == "exit3":
        sys.exit(3)


if __name__ == "__main__":
    main()
