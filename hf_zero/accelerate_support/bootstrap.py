"""Each rank of an accelerate-form ``hf-zero run`` line: install the ``Accelerator`` hand-off and
the launch settings, then hf_zero's usual bootstrap (Trainer swap) and the script.

    python -m hf_zero.accelerate_support.bootstrap train.py ARGS...
"""

from __future__ import annotations

import os


def main(argv: list[str] | None = None) -> None:
    from hf_zero.config.sources.accelerate_yaml import settings_from_environment

    settings = settings_from_environment()
    if settings is not None:
        if settings.zero_config is not None:
            from hf_zero.accelerate_support.handoff import install

            install(settings)
        from hf_zero.distributed import device as accel

        if not accel.accelerator_available():
            # The Accelerator must see every rank (MULTI_CPU) on a machine without a GPU, as under
            # `accelerate launch --cpu`; with GPUs it finds MULTI_GPU from torchrun's variables.
            os.environ.setdefault("ACCELERATE_USE_CPU", "true")
    from hf_zero.integration.bootstrap import main as trainer_bootstrap

    trainer_bootstrap(argv)


if __name__ == "__main__":
    main()
