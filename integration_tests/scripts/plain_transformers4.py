"""Run a transformers-4-era script on plain transformers 5, without hf_zero: the reference run.

    python integration_tests/scripts/plain_transformers4.py SCRIPT [ARGS...]

The user-script tests (test_user_scripts.py) compare ``hf-zero run`` of such a script with this.
It gives the script what transformers 4 with DeepSpeed installed gave it in a run where nothing is
sharded, written here independently of hf_zero (nothing is imported from it):

- ``Trainer(tokenizer=...)`` becomes ``processing_class``; ``TrainingArguments.local_rank`` is the
  local process index (``_setup_devices`` in transformers 4); ``transformers.deepspeed`` (Qwen's
  ``from transformers import deepspeed``) is ``transformers.integrations.deepspeed``, as up to 4.45;
- a ``deepspeed`` module with what the scripts import: ``zero.GatheredParameters`` does nothing
  (DeepSpeed's does nothing for parameters without ``ds_id``, and here none has one),
  ``ZeroParamStatus``, and ``comm.get_rank``/``comm.barrier`` over torch.distributed;
- ``FSDP.state_dict_type`` on a model that FSDP1 did not wrap is an empty context (current torch
  raises a KeyError when leaving it), so FastChat's non-DeepSpeed branch runs its ``save_model()``.
"""

from __future__ import annotations

import contextlib
import enum
import importlib.machinery
import os
import runpy
import sys
import types

import torch.distributed as dist
import transformers


def _fake_deepspeed() -> None:
    class ZeroParamStatus(enum.Enum):
        AVAILABLE = 1
        NOT_AVAILABLE = 2
        INFLIGHT = 3

    @contextlib.contextmanager
    def gathered_parameters(params, modifier_rank=None, fwd_module=None, enabled=True):
        yield

    root = types.ModuleType("deepspeed")
    zero = types.ModuleType("deepspeed.zero")
    zero.GatheredParameters = gathered_parameters
    comm = types.ModuleType("deepspeed.comm")
    comm.get_rank = lambda group=None: dist.get_rank(group) if dist.is_initialized() else 0
    comm.barrier = lambda group=None: dist.barrier(group) if dist.is_initialized() else None
    partition = types.ModuleType("deepspeed.runtime.zero.partition_parameters")
    partition.ZeroParamStatus = ZeroParamStatus
    runtime = types.ModuleType("deepspeed.runtime")
    runtime_zero = types.ModuleType("deepspeed.runtime.zero")
    root.zero, root.comm, root.runtime = zero, comm, runtime
    runtime.zero, runtime_zero.partition_parameters = runtime_zero, partition
    for module in (root, zero, comm, runtime, runtime_zero, partition):
        # A spec, so that importlib.util.find_spec("deepspeed") (transformers' availability check) works.
        module.__spec__ = importlib.machinery.ModuleSpec(module.__name__, None)
        sys.modules[module.__name__] = module


def _transformers4_surface() -> None:
    import transformers.integrations.deepspeed as integration

    sys.modules["transformers.deepspeed"] = integration
    transformers.deepspeed = integration
    trainer_init = transformers.Trainer.__init__

    def init(self, *args, tokenizer=None, **kwargs):
        if tokenizer is not None:
            kwargs["processing_class"] = tokenizer
        trainer_init(self, *args, **kwargs)

    transformers.Trainer.__init__ = init

    args_post_init = transformers.TrainingArguments.__post_init__

    def post_init(self):
        args_post_init(self)
        self.local_rank = self.distributed_state.local_process_index

    transformers.TrainingArguments.__post_init__ = post_init


def _fsdp1_save_context() -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    original = FSDP.state_dict_type

    def state_dict_type(module, *args, **kwargs):
        if not FSDP.fsdp_modules(module):
            return contextlib.nullcontext()
        return original(module, *args, **kwargs)

    FSDP.state_dict_type = staticmethod(state_dict_type)


def main() -> None:
    script, *args = sys.argv[1:]
    _fake_deepspeed()
    _transformers4_surface()
    _fsdp1_save_context()
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
