"""Every ```python block in docs/*.md and README.md runs (blocks of one file share a namespace)."""

import re
import warnings
from pathlib import Path

import pytest

from dtype_policies import CPUFloat16Warning
from dtype_policies.distributed.support import fsdp_refusal

ROOT = Path(__file__).resolve().parent.parent
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)
# docs whose blocks run FSDP2 on CPU (gloo): why this torch cannot, or None
FSDP_ON_CPU = {"distributed.md": fsdp_refusal("cpu")}


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_doc_code_blocks_run(path):
    blocks = BLOCK.findall(path.read_text())
    if not blocks:
        pytest.skip(f"{path.name} has no python blocks")
    if FSDP_ON_CPU.get(path.name):
        pytest.skip(FSDP_ON_CPU[path.name])
    namespace = {"__name__": f"doc_{path.stem}"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CPUFloat16Warning)
        warnings.simplefilter("ignore", UserWarning)
        for index, block in enumerate(blocks):
            try:
                exec(compile(block, f"{path.name}[block {index}]", "exec"), namespace)
            except Exception as e:
                raise AssertionError(f"{path.name} block {index} failed: {e!r}\n{block}") from e
