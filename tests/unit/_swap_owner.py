"""A second process that owns an NVMe swap folder and sleeps, for the swap-folder tests."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def start_swap_owner(nvme_path) -> tuple[subprocess.Popen, str]:
    """Start a process holding a ``SwapDir`` under ``nvme_path``; returns it and the folder's path."""
    script = textwrap.dedent(f"""
        import time
        from hf_zero.offload.nvme import SwapDir, new_run_id
        d = SwapDir({str(nvme_path)!r}, new_run_id(), 0, "s")
        print(d.path, flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()
