"""Planning asks whether torch has a schedule's class without importing torch.distributed.pipelining
(which imports torch._dynamo); the answer must equal the import's."""

from __future__ import annotations

import subprocess
import sys

from autoplace.pipeline_rules import SPECS, torch_has_schedule, torch_schedule_class


def test_reading_the_source_answers_as_the_import_does() -> None:
    assert {k: torch_has_schedule(k) for k in SPECS} == {k: torch_schedule_class(k) is not None for k in SPECS}


def test_asking_imports_nothing_of_pipelining() -> None:
    code = ("import sys; from autoplace.pipeline_rules import SPECS, torch_has_schedule; "
            "[torch_has_schedule(k) for k in SPECS]; "
            "print('torch.distributed.pipelining' in sys.modules, 'torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "False"], out.stderr[-2000:]
