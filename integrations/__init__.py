"""Thin framework glue (Lightning, HF Trainer, torchtitan), importable as `monarch_plugin.integrations.<name>`.

Each integration maps its framework's step onto the runtime's join / reduce / commit / heal calls and
imports its framework lazily, so the runtime never depends on any of them.
"""
