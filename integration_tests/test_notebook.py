"""examples/notebook/finetune_in_notebook.ipynb, executed the way Jupyter executes it.

What ``jupyter execute examples/notebook/finetune_in_notebook.ipynb`` does (docs/notebooks.md shows
that command; it is nbclient's), here through nbclient's ``NotebookClient`` so that the test can
run the notebook twice in one kernel and read the kernel's variables afterwards.

A real kernel (ipykernel, started by nbclient as Jupyter starts one) runs every cell, then every
cell again in the same kernel: the second pass must not fail because the first left a process
group behind, and it must train the same way. The test then loads the saved adapter itself, with
plain peft on a fresh base model, and checks that it generates what the notebook printed.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

nbclient = pytest.importorskip("nbclient", reason="the test extra installs nbclient and ipykernel")
nbformat = pytest.importorskip("nbformat", reason="the test extra installs nbformat")

from _run import REPO  # noqa: E402

NOTEBOOK = REPO / "examples" / "notebook" / "finetune_in_notebook.ipynb"

# Run in the kernel after the notebook: what the notebook's variables hold, and whether the
# process group it used is still there (it is what a second pass finds).
PROBE = """
import json, os
import torch.distributed as dist
print("PROBE " + json.dumps({"pid": os.getpid(), "losses": losses, "new_tokens": new_tokens.tolist(),
                             "prompt": prompt, "group": dist.is_initialized(),
                             "world_size": dist.get_world_size() if dist.is_initialized() else None}))
"""


def _stdout(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")


def _run_notebook(client, nb) -> dict:
    """Every code cell in order (an error raises CellExecutionError); the last one is the probe."""
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            client.execute_cell(cell, index)
    line = next(x for x in _stdout(nb.cells[-1]).splitlines() if x.startswith("PROBE "))
    return json.loads(line[len("PROBE "):])


def test_notebook_runs_twice_in_one_kernel_and_its_adapter_loads(tmp_path, monkeypatch):
    # As in a notebook server: no launcher variables reach the kernel (it inherits this environment).
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")
    out = tmp_path / "adapter"
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "commit the notebook without outputs"
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1 and "OUTPUT_DIR =" in params[0].source
    params[0].source += f"\nOUTPUT_DIR = Path({str(out)!r})  # set by the test\n"
    nb.cells.append(nbformat.v4.new_code_cell(PROBE))

    # The kernel starts in the notebook's folder, as Jupyter starts it.
    client = nbclient.NotebookClient(nb, timeout=180, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    with client.setup_kernel():
        first = _run_notebook(client, nb)
        train_cell_output = next(_stdout(c) for c in nb.cells if "trainer.train()" in c.source)
        second = _run_notebook(client, nb)

    assert first["pid"] == second["pid"]  # one kernel process, two passes
    assert first["group"] and first["world_size"] == 1  # the group the second pass found
    losses = first["losses"]
    assert len(losses) >= 4 and losses[-1] < losses[0] - 0.2, losses
    # What the notebook showed the user is what it trained.
    shown = re.search(r"loss: first ([\d.]+), last ([\d.]+)", train_cell_output)
    assert shown and float(shown.group(1)) == pytest.approx(losses[0], abs=1e-3), train_cell_output
    # The second pass rebuilt the model and trained it the same way (same seed, same data).
    assert second["losses"] == pytest.approx(losses, rel=1e-4)
    assert len(second["new_tokens"]) > 0 and second["new_tokens"] == first["new_tokens"]

    # The adapter on disk, loaded here with plain transformers + peft (nothing from hf_zero).
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = REPO / "assets" / "tiny-qwen2"
    assert (out / "adapter_model.safetensors").is_file() and (out / "adapter_config.json").is_file()
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), out).eval()
    lora_b = [p for n, p in tuned.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.abs().sum() > 0 for p in lora_b)  # peft starts B at zero: these trained
    tokenizer = AutoTokenizer.from_pretrained(out)
    inputs = tokenizer(second["prompt"], return_tensors="pt", return_token_type_ids=False)
    with torch.no_grad():
        generated = tuned.generate(**inputs, max_new_tokens=16, do_sample=False)
    assert generated[0, inputs["input_ids"].shape[1]:].tolist() == second["new_tokens"]
