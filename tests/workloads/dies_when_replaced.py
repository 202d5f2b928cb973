"""The demo loop, except that every replacement replica crashes at startup (a crash loop)."""

import os
import runpy
from pathlib import Path

if os.environ.get("MONARCH_PLUGIN_INITIAL") == "0":
    os._exit(3)
runpy.run_path(str(Path(__file__).resolve().parents[2] / "recipes" / "elastic_loop.py"), run_name="__main__")
