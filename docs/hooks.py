"""MkDocs hooks (`hooks:` in mkdocs.yml): the parts of the site generated from the code, so they cannot fall behind.

* `index.md`, `<!-- generated: readme-commands -->`: README's two commands (the demo, the tests), verbatim.
* `reference.md`, `<!-- generated: config-reference -->`: every `ElasticConfig` setting with its type, default and
  docstring, and how each front end spells it: `monarch-run`'s parser (`cli.build_parser`); the Lightning
  strategies and torchtitan's `MonarchConfig` take each field under its own name, but for those their framework's
  own arguments set (`FROM_TRAINER`, `OWNED`) and `LOOP_ONLY`.
* `troubleshooting.md`, `<!-- generated: error-messages -->`: every message the product raises to its users or
  prints on stderr, found by reading `monarch_plugin/` and `integrations/` (AST), grouped by module.
* A link from a page to a repository file outside `docs/` (`../tests/unit/test_docs.py`) points at
  `extra.source_url` in mkdocs.yml, or, with none set, is written as the file's path; a link to a repository file
  that does not exist fails the build, as links to missing pages and anchors do under `strict` and `validation`.

The generators are pure functions of the checkout (`tests/unit/test_docs.py` runs them). `monarch_plugin` is
imported from this checkout (its root goes first on `sys.path`); integration modules are read as source, never
imported: they need their frameworks, and `monarch_plugin.integrations` resolves to the installed checkout's.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import dataclasses
import itertools
import logging
import posixpath
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from mkdocs.exceptions import PluginError

ROOT = Path(__file__).resolve().parent.parent
"""The repository checkout these docs belong to."""

if sys.path[:1] != [str(ROOT)]:
    sys.path.insert(0, str(ROOT))

import monarch_plugin  # noqa: E402 - after the checkout is first on sys.path
from monarch_plugin import errors  # noqa: E402
from monarch_plugin.tools.cli import build_parser  # noqa: E402
from monarch_plugin.config import LOOP_ONLY, ElasticConfig, field_default, field_docs  # noqa: E402

__all__ = ["ROOT", "GENERATED", "INTERNAL", "SCANNED", "USER_FACING", "Message", "config_reference", "error_messages",
           "fill_markers", "readme_commands", "repo_links", "troubleshooting", "on_config", "on_page_markdown"]

log = logging.getLogger("mkdocs.hooks.monarch_docs")

SCANNED = ("monarch_plugin", "integrations")
"""The product's code, relative to ROOT: what the troubleshooting list is read from."""

USER_FACING = frozenset(errors.__all__) | {
    "MisconfigurationException", "ValueError", "TypeError", "RuntimeError", "ImportError", "SystemExit",
    "Forged",
}
"""Exception types whose messages reach users: the product's own (`monarch_plugin.errors`), Lightning's
configuration error, and the built-in types the product raises with a message that names the fix."""

INTERNAL = {
    "GenerationChanged": "a newer generation superseded a collective; the worker joins it",
    "CollectiveFailed": "a cross-replica collective failed; the step is dropped and the controller decides",
    "CollectiveTimedOut": "a reduction ran past `collective_timeout_s`; reported to the controller as a hang",
    "CollectiveInterrupted": "the base of the three above",
    "StopReplica": "the controller stopped this replica (give-up, or not in the newest generation)",
    "EndedFirst": "a stop found training already ended; the controller's loop ends the run as finished",
    "InjectedFault": "the opt-in `raise` fault: an exception in the training code, which the run survives as any",
    "OutOfMemoryError": "the opt-in `oom` fault: a device out of memory, as torch raises it",
    "DataloaderExhaustedError": "torchtitan's end-of-data signal, which its own loop handles",
    "AttributeError": "Python's attribute protocol on the `monarch_plugin` package",
}
"""Exception types raised with a message that is not shown as the run's error: signals handled inside the
runtime (or its frameworks), and why each is not listed."""

MARKER = re.compile(r"<!-- generated: ([\w-]+) -->")

_OPEN, _CLOSE = "\x02", "\x03"
"""What a part known only at run time is wrapped in while a message is put together (`<...>` on the page)."""
_PLACEHOLDER = re.compile(f"{_OPEN}[^{_OPEN}{_CLOSE}]*{_CLOSE}")
_INLINE_ALTERNATIVES = 40
"""Alternatives of a message part up to this long are written inline, `{a | b}`; longer ones are separate messages."""
_MAX_VARIANTS = 8
"""At most this many messages from one `raise`; beyond it every alternative is written inline."""
_DEPTH = 8
"""How many names, calls and arguments deep a message's parts are followed."""
_RELAY_WORDS = 4
"""A message that carries a caught error's and has at most this many words of its own is a prefix, passed on."""


# -- README's commands ------------------------------------------------------------------------------------------

_README_BLOCK = re.compile(r"^[^\n]+\n\n```bash\n.*?\n```$", re.M | re.S)
"""A command block of README's, with the line before it that says what it does."""


def readme_commands(readme: str) -> str:
    """README's first two command blocks, each after the line that introduces it: what the quickstart shows."""
    blocks = _README_BLOCK.findall(readme)[:2]
    if len(blocks) < 2 or "monarch-run" not in blocks[0] or "pytest" not in blocks[1]:
        raise PluginError("README.md no longer opens with its two ```bash blocks (the demo with monarch-run, then "
                          "the tests with pytest): restore them, or change readme_commands in docs/hooks.py")
    return "\n\n".join(blocks)


# -- the configuration reference --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _FrontEnds:
    """What the Lightning strategies and torchtitan's `--monarch.*` section say of the runtime's settings beyond
    their names, read from their source: both take every `front_end_fields` field under its own name."""

    lightning: dict[str, str]
    """Field -> the Lightning arguments that set it instead of a keyword argument (`FROM_TRAINER`)."""
    lightning_notes: dict[str, str]
    """Field -> what the Lightning argument means where it means more than the field (`_NOTES`)."""
    lightning_doc: str
    """`FROM_TRAINER`'s docstring."""
    titan: dict[str, str]
    """Field -> the torchtitan setting that gives it instead of `--monarch.<field>` (`OWNED`)."""
    titan_notes: dict[str, str]
    titan_enable: str
    """The docstring of `--monarch.enable`, the section's one setting of its own (`ENABLE`)."""


def _literal(tree: ast.Module, name: str) -> tuple[object, str]:
    """The literal value assigned to the module-level `name`, and the docstring under it."""
    for node, after in itertools.zip_longest(tree.body, tree.body[1:]):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            doc = after.value.value if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) else ""
            return ast.literal_eval(node.value), " ".join(doc.split())
    raise PluginError(f"no module-level `{name} = ...` in the source read for the docs: update docs/hooks.py")


def _front_ends(root: Path) -> _FrontEnds:
    """The Lightning and torchtitan notes, read from `integrations/` as source."""
    launcher = ast.parse((root / "integrations/lightning/launcher.py").read_text())
    titan = ast.parse((root / "integrations/torchtitan/config.py").read_text())
    lightning, lightning_doc = _literal(launcher, "FROM_TRAINER")
    return _FrontEnds(lightning, _literal(launcher, "_NOTES")[0], lightning_doc, _literal(titan, "OWNED")[0],
                      _literal(titan, "_NOTES")[0], _literal(titan, "ENABLE")[0])


def _code(text: object) -> str:
    """`text` as an inline code span, whatever backticks it holds."""
    text = str(text)
    fence = "``" if "`" in text else "`"
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _linked(doc: str, names: set[str]) -> str:
    """A docstring for the page: ``double`` backticks become single, and each setting it names links to its section."""
    doc = doc.replace("``", "`")
    return re.sub(r"`(\w+)`", lambda m: f"[`{m[1]}`](#{m[1]})" if m[1] in names else m[0], doc)


def _flag(action: argparse.Action | None, kind: str) -> str:
    """How `monarch-run --help` writes a flag, with its value."""
    if action is None:
        return "none (`monarch-run` passes its own environment on: export the variables)"
    flag = action.option_strings[0]
    if action.nargs == 0:
        return _code(flag)
    value = "{" + ",".join(action.choices) + "}" if action.choices else action.metavar
    comma = " (comma-separated)" if kind == "list[str]" else ""
    return _code(f"{flag} {value}") + comma


def config_reference(root: Path = ROOT) -> str:
    """The reference's generated part: an overview table of every `ElasticConfig` setting, then a section each
    (type, default, docstring, and every front end's spelling), then torchtitan's own `--monarch.enable`."""
    fronts = _front_ends(root)
    docs = field_docs()
    fields = dataclasses.fields(ElasticConfig)
    names = {f.name for f in fields}
    actions = {a.dest: a for a in build_parser()._actions if a.option_strings}
    table = ["| setting | type | default | `monarch-run` (and HF) | Lightning `MonarchStrategy(...)` | torchtitan |",
             "|---|---|---|---|---|---|"]
    sections = []
    loop_only = "not taken: `ElasticLoop`'s own (the framework keeps the global batch and its checkpoints its own way)"
    for f in fields:
        default = field_default(f)
        action = actions.get(f.name)
        run = _flag(action, f.type)
        if f.name in LOOP_ONLY:
            lightning = titan = loop_only
            lightning_cell = titan_cell = "—"
        else:
            lightning = lightning_cell = _code(f.name)
            if f.name in fronts.lightning:
                lightning = f"from Lightning's own arguments: {fronts.lightning[f.name]}"
                lightning_cell = "[see Lightning](#lightning)"
            titan = titan_cell = _code(f"--monarch.{f.name}")
            if f.name in fronts.titan:
                titan, titan_cell = f"not a flag: set from {fronts.titan[f.name]}", "—"
        run_cell = _code(action.option_strings[0]) if action else "—"
        table.append(f"| [`{f.name}`](#{f.name}) | {_code(f.type.replace(' | ', ' or '))} | {_code(repr(default))} "
                     f"| {run_cell} | {lightning_cell} | {titan_cell} |")
        rows = [f"| `monarch-run` (and HF) | {run} |", f"| Lightning | {lightning} |", f"| torchtitan | {titan} |",
                f"| Python | `ElasticConfig({f.name}=...)` |"]
        section = [f"### `{f.name}`", "", f"{_code(f.type)}, default {_code(repr(default))}", "",
                   _linked(docs[f.name], names), "", "| front end | spelling |", "|---|---|", *rows]
        for front, notes in (("Lightning", fronts.lightning_notes), ("torchtitan", fronts.titan_notes)):
            if f.name in notes:
                section += ["", f"{front}: {_linked(notes[f.name], names)}"]
        sections.append("\n".join(section))
    parts = [
        "## Overview", "", "\n".join(table), "",
        "## Lightning", "", _linked(fronts.lightning_doc, names), "",
        "## Settings", "", "\n\n".join(sections), "",
        "## Only in torchtitan's section", "",
        f"### `--monarch.enable`\n\n`bool`, default `False`\n\n{_linked(fronts.titan_enable, names)}",
    ]
    return "\n".join(parts) + "\n"


# -- the error messages -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Message:
    """One message the product can show a user, and where it comes from."""

    path: str
    """The module's file, relative to the repository root."""
    where: str
    """The function (`Class.method`) that raises or prints it."""
    line: int
    kind: str
    """The exception type, or `stderr` for a message printed there."""
    text: str
    """The message, each part computed at run time written `<expression>`; `{a | b}`: one of those; `[x]`: x only
    sometimes."""
    passed_on: bool
    """The message carries another error's message with little of its own (a front end's prefix)."""


def _is_str(node: ast.expr) -> bool:
    """Whether `node` is a string literal, or strings joined with `+`."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _is_str(node.left) or _is_str(node.right)
    return isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant) and isinstance(node.value, str))


def _callee(node: ast.expr) -> str | None:
    """The called name: `f` for `f(...)`, `g` for `a.b.g(...)`."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _placeholder(node: ast.expr) -> str:
    """A part of a message known only at run time: its expression, `<min_replicas>` for `{self.min_replicas}`."""
    return _OPEN + ast.unparse(node).replace("self.", "") + _CLOSE


class _Module:
    """One source file, read for the messages it raises and prints."""

    def __init__(self, path: str, tree: ast.Module, functions: dict[str, list[tuple[_Module, ast.FunctionDef]]]):
        self.path, self.tree, self.functions = path, tree, functions
        self.parents: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
        self.constants = {t.id: n.value for n in tree.body if isinstance(n, ast.Assign)
                          for t in n.targets if isinstance(t, ast.Name)}

    def scope(self, node: ast.AST) -> list[ast.AST]:
        """The classes and functions around `node`, outermost first."""
        chain = []
        while node in self.parents:
            node = self.parents[node]
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                chain.append(node)
        return chain[::-1]

    def function(self, node: ast.AST) -> ast.FunctionDef | None:
        funcs = [s for s in self.scope(node) if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))]
        return funcs[-1] if funcs else None

    def variants(self, node: ast.expr, func: ast.FunctionDef | None, depth: int = 0) -> list[str]:
        """The texts `node` can evaluate to, with what is only known at run time as `<expression>`."""
        if isinstance(node, ast.Constant):
            return [str(node.value)]
        if isinstance(node, ast.JoinedStr):
            return self._join([[str(v.value)] if isinstance(v, ast.Constant) else self.part(v.value, func, depth)
                               for v in node.values])
        if isinstance(node, ast.BinOp) and _is_str(node):
            return self._join([self.variants(node.left, func, depth), self.variants(node.right, func, depth)])
        return self.part(node, func, depth)

    def part(self, node: ast.expr, func: ast.FunctionDef | None, depth: int) -> list[str]:
        """The texts of an expression inside a message: a string, a name bound to strings, a call of a function
        that returns them, `sep.join(CONSTANT)`; else `<expression>`."""
        if depth < _DEPTH:
            if _is_str(node):
                return self.variants(node, func, depth + 1)
            if isinstance(node, ast.IfExp):
                either = self.part(node.body, func, depth + 1) + self.part(node.orelse, func, depth + 1)
                if not all(_PLACEHOLDER.fullmatch(t) for t in either):
                    return self._either(either)
            if isinstance(node, ast.Name):
                found = self._name(node, func, depth + 1)
                if found:
                    return found
            if isinstance(node, ast.Call):
                found = self._call(node, func, depth + 1)
                if found:
                    return found
        return [_placeholder(node)]

    def _name(self, ref: ast.Name, func: ast.FunctionDef | None, depth: int) -> list[str] | None:
        """The texts a name in a message stands for: the loop around it, its function's argument or assignments,
        or a module-level string."""
        name = ref.id
        node: ast.AST = ref
        while node in self.parents and node is not func:
            node = self.parents[node]
            if isinstance(node, ast.For) and isinstance(node.target, ast.Name) and node.target.id == name:
                items = node.iter.elts if isinstance(node.iter, (ast.Tuple, ast.List)) else []
                if items and all(isinstance(e, ast.Constant) for e in items):
                    return self._either([str(e.value) for e in items])
                return None
        if func is not None:
            params = [a.arg for a in func.args.posonlyargs + func.args.args + func.args.kwonlyargs]
            if name in params:
                return self._arguments(func, params.index(name), name, depth)
            values: list[str] = []
            for node in ast.walk(func):
                if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                    values += self.part(node.value, func, depth)
            if values and not all(_PLACEHOLDER.fullmatch(v) for v in values):
                return self._either(values)
        value = self.constants.get(name)
        if value is not None and _is_str(value):
            return self.variants(value, None, depth)
        return None

    def _arguments(self, func: ast.FunctionDef, index: int, name: str, depth: int) -> list[str] | None:
        """The texts a private function's parameter is given at its calls in this module."""
        if not func.name.startswith("_"):
            return None
        method = bool(func.args.args) and func.args.args[0].arg in ("self", "cls")
        values: list[str] = []
        for call in ast.walk(self.tree):
            if not (isinstance(call, ast.Call) and _callee(call.func) == func.name):
                continue
            position = index - 1 if method and isinstance(call.func, ast.Attribute) else index
            given = [k.value for k in call.keywords if k.arg == name]
            given += call.args[position:position + 1] if 0 <= position < len(call.args) else []
            if given and not isinstance(given[0], ast.Starred):
                values += self.part(given[0], self.function(call), depth)
        if not values or all(_PLACEHOLDER.fullmatch(v) for v in values):
            return None
        return self._either(values)

    def _call(self, call: ast.Call, func: ast.FunctionDef | None, depth: int) -> list[str] | None:
        if (isinstance(call.func, ast.Attribute) and call.func.attr == "join" and _is_str(call.func.value)
                and len(call.args) == 1 and isinstance(call.args[0], ast.Name)):
            items = self.constants.get(call.args[0].id)
            if isinstance(items, (ast.Tuple, ast.List)) and all(isinstance(e, ast.Constant) for e in items.elts):
                return [call.func.value.value.join(str(e.value) for e in items.elts)]
        defs = self.functions.get(_callee(call.func) or "", [])
        if len(defs) != 1:
            return None
        module, callee = defs[0]
        returns = [r.value for r in ast.walk(callee) if isinstance(r, ast.Return) and r.value is not None
                   and not (isinstance(r.value, ast.Constant) and r.value.value is None)]
        texts = [t for r in returns for t in module.part(r, callee, depth)]
        if not texts or all(_PLACEHOLDER.fullmatch(t) for t in texts):
            return None
        return self._either(texts)

    @staticmethod
    def _either(values: list[str]) -> list[str]:
        """Alternatives of one part: `[x]` when the other is empty, `{a | b}` when all are short."""
        values = list(dict.fromkeys(values))
        if len(values) == 2 and "" in values:
            return [f"[{values[0] or values[1]}]"]
        if len(values) > 1 and all(len(v) <= _INLINE_ALTERNATIVES for v in values):
            return ["{" + " | ".join(values) + "}"]
        return values

    @staticmethod
    def _join(parts: list[list[str]]) -> list[str]:
        if len(list(itertools.islice(itertools.product(*parts), _MAX_VARIANTS + 1))) > _MAX_VARIANTS:
            parts = [p if len(p) == 1 else ["{" + " | ".join(p) + "}"] for p in parts]
        return ["".join(p) for p in itertools.product(*parts)]

    # -- where messages are raised and printed

    def messages(self, exceptions: set[str]) -> Iterator[Message]:
        """Every message this file raises or prints on stderr; `exceptions` are the names that are exception
        types, each of which must be in USER_FACING or INTERNAL."""
        for node in ast.walk(self.tree):
            call, kind = None, None
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                call, kind = node.exc, _callee(node.exc.func)
                if kind in INTERNAL or (kind not in USER_FACING and kind not in exceptions):
                    continue
                if kind not in USER_FACING:
                    raise PluginError(f"{self.path}:{node.lineno} raises {kind}, which docs/hooks.py does not "
                                      "classify: add it to USER_FACING (its messages reach users) or INTERNAL "
                                      "(a signal handled inside the runtime)")
            elif (isinstance(node, ast.Return) and isinstance(node.value, ast.Call)
                  and _callee(node.value.func) in USER_FACING):
                call, kind = node.value, _callee(node.value.func)  # a helper that builds the error it raises
            elif (isinstance(node, ast.Call) and _callee(node.func) == "print"
                  and any(k.arg == "file" and ast.unparse(k.value) == "sys.stderr" for k in node.keywords)):
                call, kind = node, "stderr"
            if call is None or not call.args:
                continue
            func = self.function(call)
            where = ".".join(s.name for s in self.scope(call)) or "<module>"
            caught = {h.name for h in ast.walk(func) if isinstance(h, ast.ExceptHandler) and h.name} if func else set()
            relays = any(isinstance(n, ast.Name) and n.id in caught for n in ast.walk(call.args[0]))
            for text in self.variants(call.args[0], func):
                words = re.findall(r"[A-Za-z]{2,}", _PLACEHOLDER.sub("", text))
                if not words and not relays:
                    continue  # a message that is all run-time values: nothing to look up
                shown = text.replace(_OPEN, "<").replace(_CLOSE, ">")
                yield Message(self.path, where, call.lineno, kind, shown, relays and len(words) <= _RELAY_WORDS)


def _exception_classes(modules: list[_Module]) -> set[str]:
    """Exception classes defined in the scanned code, and every name that looks like one (`...Error`)."""
    known = {n for n in dir(builtins) if isinstance(getattr(builtins, n), type)
             and issubclass(getattr(builtins, n), BaseException)}
    classes = [c for m in modules for c in ast.walk(m.tree) if isinstance(c, ast.ClassDef)]
    while True:
        more = {c.name for c in classes if c.name not in known
                and any(_callee(b) in known or (_callee(b) or "").endswith(("Error", "Exception")) for b in c.bases)}
        if not more:
            break
        known |= more
    names = {_callee(n.exc.func) for m in modules for n in ast.walk(m.tree)
             if isinstance(n, ast.Raise) and isinstance(n.exc, ast.Call)}
    return known | {n for n in names if n and n.endswith(("Error", "Exception"))}


def error_messages(root: Path = ROOT) -> list[Message]:
    """Every message under SCANNED that a user can see, in module order (the runtime, then each integration), once
    per module (the first place it is raised)."""
    functions: dict[str, list] = {}
    modules = []
    for top in SCANNED:
        for path in sorted((root / top).rglob("*.py")):
            module = _Module(path.relative_to(root).as_posix(), ast.parse(path.read_text()), functions)
            modules.append(module)
            for node in ast.walk(module.tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    functions.setdefault(node.name, []).append((module, node))
    exceptions = _exception_classes(modules)
    found, seen = [], set()
    for module in modules:
        for message in sorted(module.messages(exceptions), key=lambda m: m.line):
            if (message.path, message.kind, message.text) not in seen:
                seen.add((message.path, message.kind, message.text))
                found.append(message)
    return found


def _fenced(text: str) -> str:
    fence = "```" if "```" not in text else "~~~~"
    return f"{fence}text\n{text}\n{fence}"


def troubleshooting(root: Path = ROOT) -> str:
    """The troubleshooting page's generated part: what is listed, then every message by module."""
    messages = error_messages(root)
    own = [m for m in messages if not m.passed_on]
    relayed = [m for m in messages if m.passed_on]
    kinds = ", ".join(f"`{k}`" for k in sorted(USER_FACING))
    internal = "\n".join(f"* `{k}`: {why}" for k, why in INTERNAL.items())
    parts = [
        f"{len(own)} messages from {len({m.path for m in own})} modules, read from the code when this site was built. "
        f"Listed: every `raise` (or a helper's `return`) of {kinds} with a message, and every message printed on "
        "stderr. Not listed, because they are signals handled inside the runtime rather than errors shown to you:",
        "", internal, "",
    ]
    for path, group in itertools.groupby(own, key=lambda m: m.path):
        parts += [f"### `{path}`", ""]
        for m in group:
            parts += [f"**`{m.kind}`** in `{m.where}` (line {m.line})", "", _fenced(m.text), ""]
    parts += ["## Messages passed on", "",
              "These carry another message (one of those above, in the front end's spelling) with a prefix:", "",
              "| message | kind | where |", "|---|---|---|"]
    parts += [f"| {_code(m.text)} | `{m.kind}` | `{m.path}`: `{m.where}` |" for m in relayed]
    return "\n".join(parts) + "\n"


# -- links to repository files ----------------------------------------------------------------------------------

_LINK = re.compile(r"(?P<image>!?)\[(?P<text>[^\]\n]*)\]\((?P<target>[^)\s]+)\)")


def repo_links(markdown: str, page: str, source_url: str | None, root: Path = ROOT) -> str:
    """`markdown` of the page `page` (its path in docs/) with each link that leaves docs/ for a repository file
    pointing at `source_url` + the file's path, or, without a source_url, written as that path in code. A link
    to a repository file that does not exist raises naming the page and the link. Fenced code is left alone."""

    def rewrite(m: re.Match) -> str:
        target = m["target"]
        if re.match(r"[a-z][a-z0-9+.-]*:|[#/]", target):
            return m[0]  # another site, an anchor on this page, or an absolute path (validation reports those)
        path, _, anchor = target.partition("#")
        inside = posixpath.normpath(posixpath.join(posixpath.dirname(page), path))
        if not inside.startswith("../"):
            return m[0]  # a page or file of the site: mkdocs validates it
        file = posixpath.normpath(posixpath.join("docs", inside))
        if file.startswith("../") or not (root / file).exists():
            raise PluginError(f"docs/{page} links to {target}, which is no file of the repository: fix the link")
        if m["image"]:
            raise PluginError(f"docs/{page} shows the image {target} from outside docs/: move the image into docs/")
        if source_url:
            return f"[{m['text']}]({source_url.rstrip('/')}/{file}{'#' + anchor if anchor else ''})"
        return m["text"] if file in m["text"] else f"{m['text']} ({_code(file)})"

    out, fence = [], None
    for line in markdown.splitlines(keepends=True):
        opener = re.match(r"\s*(```|~~~)", line)
        if fence is None and opener:
            fence = opener[1]
        elif fence is not None and line.strip().startswith(fence):
            fence = None
        elif fence is None:
            line = _LINK.sub(rewrite, line)
        out.append(line)
    return "".join(out)


# -- the hooks --------------------------------------------------------------------------------------------------

GENERATED = {
    "index.md": {"readme-commands": lambda: readme_commands((ROOT / "README.md").read_text())},
    "reference.md": {"config-reference": config_reference},
    "troubleshooting.md": {"error-messages": troubleshooting},
}
"""Each generated page's markers, and what fills each."""


def fill_markers(markdown: str, page: str) -> str:
    """`markdown` with each of the page's markers replaced by its generated text; a marker that is missing or
    that the page does not own fails the build."""
    owned = GENERATED.get(page, {})
    present = MARKER.findall(markdown)
    stray = [name for name in present if name not in owned]
    missing = [name for name in owned if name not in present]
    if stray or missing:
        raise PluginError(f"docs/{page}: markers {stray or missing} are not where docs/hooks.py GENERATED puts "
                          "them: restore `<!-- generated: NAME -->` on its page, or update GENERATED")
    return MARKER.sub(lambda m: owned[m[1]]().rstrip("\n"), markdown)


def on_config(config):
    """Check that the code the pages are generated from is this checkout's."""
    imported = Path(monarch_plugin.__file__).resolve().parent
    if imported != ROOT / "monarch_plugin":
        raise PluginError(f"the docs of {ROOT} would be generated from monarch_plugin at {imported}: run mkdocs from "
                          f"this checkout's environment, or put {ROOT} first on PYTHONPATH")
    return config


def on_page_markdown(markdown: str, page, config, files) -> str:
    """Fill the page's generated parts, then point its links to repository files at the source."""
    markdown = fill_markers(markdown, page.file.src_uri)
    return repo_links(markdown, page.file.src_uri, config.extra.get("source_url"))
