"""`target`: what a training target imports, read from its source."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(60)


def test_a_targets_imports_are_read_from_its_source_not_run(tmp_path):
    from monarch_plugin.target import Target

    script = tmp_path / "train.py"
    script.write_text("import os, lightning.pytorch as pl\nfrom transformers import AutoModel\nfrom . import near\n"
                      "def main():\n    import torchtitan.train\nraise SystemExit('never run')\n")
    assert Target.script(str(script)).imports == ["lightning", "os", "torchtitan", "transformers"]
    broken = tmp_path / "broken.py"
    broken.write_text("def (:\n")
    assert Target.script(str(broken)).imports == []
    assert "torch" in Target.function(_module_level_fn).imports  # this file's own imports
    assert Target.function(print).imports == []  # a builtin has no source


def _module_level_fn():
    import torch  # noqa: F401
