"""docs/checkpoints.md runs as written: its commands (through the CLI) and its Python block, on a
checkpoint this test writes where the page's `my-llama` is: sharded, tied embeddings, and float32,
as an ordinary checkpoint is (the page's `--meta --dtype bfloat16` failed on one, issue 61)."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest
import torch
import transformers as tf

from .helpers_cli import invoke

pytestmark = pytest.mark.usefixtures("_restore_process_state")  # tests/conftest.py: undo what the CLI changes

PAGE = Path(__file__).resolve().parents[1] / "docs" / "checkpoints.md"


def test_checkpoints_page_runs(tmp_path) -> None:
    text = PAGE.read_text()
    commands = [line.split("#")[0].strip() for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S)
                for line in block.splitlines() if line.startswith("fxprep ")]
    python = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(commands) == 3 and len(python) == 1
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    tf.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "my-llama", max_shard_size="40KB")
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        for command in commands:
            if "--device cuda" in command and not torch.cuda.is_available():
                command = command.replace("--device cuda", "--device cpu")
            result = invoke(*shlex.split(command)[1:])
            assert result.exit_code == 0, (command, result.output)
        exec(compile(python[0], str(PAGE), "exec"), {})  # noqa: S102 - the page's own code
    finally:
        os.chdir(cwd)
